# Model preparation: one MLX checkpoint per `models` entry. Depends only on that entry, so
# changing data, seq, eval or training options never re-prepares the model.


rule prepare_model:
    output:
        directory("results/{model}/model"),
    params:
        source=lambda w: model_source(w)[0],
        ref=lambda w: model_source(w)[1],
        extra=model_extra,
    log:
        "results/logs/{model}/prepare_model.log",
    benchmark:
        "results/benchmarks/{model}/prepare_model.tsv"
    threads: HEAVY_THREADS
    resources:
        mem_mb=MEM_MB,
    shell:
        "segback prepare-model --source {params.source} --ref {params.ref:q} {params.extra}"
        " --out {output} > {log} 2>&1"
