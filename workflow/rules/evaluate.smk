# Generation on the held-out test set, without an adapter (baseline, independent of `seq`) and
# with the exported mlx-lm adapter (fine-tuned), then scoring against the gold chunks.


rule baseline_eval:
    input:
        model="results/{model}/model",
        data="results/{model}/data/test.jsonl",
    output:
        "results/{model}/baseline/predictions.jsonl",
    params:
        max_new_tokens=EVAL["max_new_tokens"],
        **GENERATE_PARAMS,
    log:
        "results/logs/{model}/baseline_eval.log",
    benchmark:
        "results/benchmarks/{model}/baseline_eval.tsv"
    threads: HEAVY_THREADS
    resources:
        mem_mb=MEM_MB,
        gpu=GPU,
    shell:
        "segback generate --model {input.model} --data {input.data} --out {output}"
        " --max-tokens {params.max_new_tokens}" + GENERATE_FLAGS + " > {log} 2>&1"


rule finetuned_eval:
    input:
        model="results/{model}/model",
        export="results/{model}/seq{seq}/export",
        data="results/{model}/data/test.jsonl",
    output:
        "results/{model}/seq{seq}/finetuned/predictions.jsonl",
    params:
        adapter=lambda w, input: os.path.join(input.export, "mlx"),
        max_new_tokens=EVAL["max_new_tokens"],
        **GENERATE_PARAMS,
    log:
        "results/logs/{model}/seq{seq}/finetuned_eval.log",
    benchmark:
        "results/benchmarks/{model}/seq{seq}/finetuned_eval.tsv"
    threads: HEAVY_THREADS
    resources:
        mem_mb=MEM_MB,
        gpu=GPU,
    shell:
        "segback generate --model {input.model} --adapter {params.adapter}"
        " --data {input.data} --out {output} --max-tokens {params.max_new_tokens}"
        + GENERATE_FLAGS + " > {log} 2>&1"


# {variant} is "baseline" or "seq{seq}/finetuned".
rule score:
    input:
        data="results/{model}/data/test.jsonl",
        pred="results/{model}/{variant}/predictions.jsonl",
    output:
        "results/{model}/{variant}/score.json",
    log:
        "results/logs/{model}/{variant}/score.log",
    benchmark:
        "results/benchmarks/{model}/{variant}/score.tsv"
    threads: 1
    resources:
        mem_mb=2000,
    shell:
        "segback score --data {input.data} --pred {input.pred} --out {output} > {log} 2>&1"
