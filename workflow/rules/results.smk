# Report figures and the final result: results/{model}_chunk_score.json (validated against
# segback/result.schema.json) and its HTML score table. summarize takes the configured
# `seq`, so changing `seq` re-runs it (its inputs change).


rule plots:
    input:
        "results/{model}/seq{seq}/train_log.jsonl",
    output:
        loss=report(
            "results/{model}/seq{seq}/plots/loss.png",
            caption="../report/loss.rst",
            category="Training",
            labels={"model": "{model}", "seq": "{seq}", "figure": "loss"},
        ),
        memory=report(
            "results/{model}/seq{seq}/plots/memory.png",
            caption="../report/memory.rst",
            category="Training",
            labels={"model": "{model}", "seq": "{seq}", "figure": "peak memory"},
        ),
    params:
        out_dir=lambda w, output: os.path.dirname(output.loss),
        title="{model} seq {seq}",
    log:
        "results/logs/{model}/seq{seq}/plots.log",
    benchmark:
        "results/benchmarks/{model}/seq{seq}/plots.tsv"
    threads: 1
    resources:
        mem_mb=1000,
    shell:
        "segback plots --log {input} --out-dir {params.out_dir} --title {params.title:q}"
        " > {log} 2>&1"


# Each stage's effective config as a file: a changed option re-runs the summary (and what it
# needs) even after a failed job's outputs were deleted; the result records the hashes.
rule config_stamp:
    output:
        "results/{model}/config/{stage}.json",
    params:
        config=lambda w: stage_config(w.model, w.stage),
    log:
        "results/logs/{model}/config_stamp_{stage}.log",
    threads: 1
    shell:
        "segback stamp --stage {wildcards.stage} --config {params.config:q} --out {output}"
        " > {log} 2>&1"


rule summarize:
    input:
        stamps=expand("results/{{model}}/config/{stage}.json", stage=("data", "train", "eval")),
        schema=os.path.join(workflow.basedir, "segback/result.schema.json"),
        baseline="results/{model}/baseline/score.json",
        finetuned=f"results/{{model}}/seq{SEQ}/finetuned/score.json",
        adapter=f"results/{{model}}/seq{SEQ}/adapter",
        plan=lambda w: plan_file(w.model, SEQ),
        loss=f"results/{{model}}/seq{SEQ}/plots/loss.png",
        memory=f"results/{{model}}/seq{SEQ}/plots/memory.png",
    output:
        json=report(
            "results/{model}_chunk_score.json",
            caption="../report/result.rst",
            category="Scores",
            labels={"model": "{model}", "table": "result JSON"},
        ),
        table=report(
            "results/{model}_chunk_score.html",
            caption="../report/score_table.rst",
            category="Scores",
            labels={"model": "{model}", "table": "baseline vs fine-tuned"},
        ),
    params:
        train_summary=lambda w, input: os.path.join(input.adapter, "train_summary.json"),
        benchmarks=lambda w: benchmark_files(w.model, SEQ),
    log:
        "results/logs/{model}/summarize.log",
    benchmark:
        "results/benchmarks/{model}/summarize.tsv"
    threads: 1
    resources:
        mem_mb=1000,
    shell:
        "segback summarize --model-name {wildcards.model} --baseline {input.baseline}"
        " --finetuned {input.finetuned} --train-summary {params.train_summary}"
        " --plan {input.plan} --schema {input.schema} --benchmarks {params.benchmarks}"
        " --artifact loss_plot={input.loss} --artifact memory_plot={input.memory}"
        " $(printf -- '--stamp %s ' {input.stamps})"
        " --out {output.json} --table {output.table} > {log} 2>&1"
