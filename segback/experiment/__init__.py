"""Code only the Snakemake workflow uses: the config check when it loads (`config_check`), stale
locks (`workflow_lock`), stage stamps (`stamp`), the generic task's evaluation (`evaluate`), the
result JSON (`results`, against `result.schema.json` / `generic_result.schema.json`) and the
report's plots (`plots`). The chunking task itself is `segback.chunking`."""
