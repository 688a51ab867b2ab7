"""Code only the Snakemake workflow uses: the config check when it loads (`config_check`), stale
locks (`workflow_lock`), stage stamps (`stamp`), the generic task's evaluation (`evaluate`), the
result JSON (`summarize` writes a `chunk_result` or a `generic_result`, both built from
`result_parts` and shown by `result_html`, or a sweep's `sweep_summary`) and the report's plots
(`plots`). The chunking task itself is `segback.chunking`."""
