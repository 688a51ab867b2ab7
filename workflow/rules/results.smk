# Report figures and the final result. The figures (plots) and the config stamps serve both
# tasks. task: chunking: results/{model}_chunk_score.json (validated against
# segback/experiment/result.schema.json) and its HTML score table. summarize takes the configured
# `seq`, so changing `seq` re-runs it (its inputs change). A sweep (common.smk) summarizes each
# branch into results/{model}/seq{seq}/chunk_score.json (summarize_branch) and gathers the
# branches into results/sweep_summary.{json,md,html} (sweep_summary). task: generic has its own
# summary rules (generic.smk).


rule plots:
    input:
        RUN + "/seq{seq}/train_log.jsonl",
    output:
        loss=report(
            RUN + "/seq{seq}/plots/loss.png",
            caption="../report/loss.rst",
            category="Training",
            labels={"model": "{model}", "seq": "{seq}", "figure": "loss"},
        ),
        memory=report(
            RUN + "/seq{seq}/plots/memory.png",
            caption="../report/memory.rst",
            category="Training",
            labels={"model": "{model}", "seq": "{seq}", "figure": "peak memory"},
        ),
    params:
        out_dir=lambda w, output: os.path.dirname(output.loss),
        title=f"{{model}} on {NAME}, seq {{seq}}" if GENERIC else "{model} seq {seq}",
    log:
        LOGS + "/seq{seq}/plots.log",
    benchmark:
        BENCH + "/seq{seq}/plots.tsv"
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
        RUN + "/config/{stage}.json",
    params:
        config=lambda w: stage_config(w.model, w.stage),
    log:
        LOGS + "/config_stamp_{stage}.log",
    threads: 1
    shell:
        "segback stamp --stage {wildcards.stage} --config {params.config:q} --out {output}"
        " > {log} 2>&1"


if not GENERIC:

    rule summarize:
        input:
            stamps=lambda w: stamp_files(w.model, w.seq if "seq" in w.keys() else None),
            schema=os.path.join(workflow.basedir, "segback/experiment/result.schema.json"),
            baseline="results/{model}/baseline/score.json",
            finetuned=lambda w: f"results/{w.model}/seq{wildcard_tag(w)}/finetuned/score.json",
            adapter=lambda w: f"results/{w.model}/seq{wildcard_tag(w)}/adapter",
            plan=lambda w: plan_file(w.model, wildcard_tag(w)),
            loss=lambda w: f"results/{w.model}/seq{wildcard_tag(w)}/plots/loss.png",
            memory=lambda w: f"results/{w.model}/seq{wildcard_tag(w)}/plots/memory.png",
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
            benchmarks=lambda w: benchmark_files(w.model, wildcard_tag(w)),
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


    # One sweep branch's result: the same summary, for the branch named by its path.
    use rule summarize as summarize_branch with:
        output:
            json=report(
                "results/{model}/seq{seq}/chunk_score.json",
                caption="../report/result.rst",
                category="Scores",
                labels={"model": "{model}", "seq": "{seq}", "table": "result JSON"},
            ),
            table=report(
                "results/{model}/seq{seq}/chunk_score.html",
                caption="../report/score_table.rst",
                category="Scores",
                labels={"model": "{model}", "seq": "{seq}", "table": "baseline vs fine-tuned"},
            ),
        log:
            "results/logs/{model}/seq{seq}/summarize.log",
        benchmark:
            "results/benchmarks/{model}/seq{seq}/summarize.tsv"


    # eval.length_buckets: the baseline and every branch of a model side by side on its test
    # set, split by conversation length (segback compare); a sweep's table shows them too.
    BUCKETS = EVAL.get("length_buckets")


    def arm_name(branch):
        """A branch's name in the comparison: how it was trained (whole cases or windows)."""
        if branch["window"]:
            name = f"windows {branch['window']}" + (f" of {branch['seq']}" if len(SEQS) > 1 else "")
        else:
            name = f"whole {branch['seq']}"
        return name + (f" r{branch['lora_rank']}" if RANK_SWEPT else "")


    def arms_of(model):
        """The baseline and the branches of `model`, as `segback compare --arms` takes them."""
        arms = [{"name": "baseline", "score": f"results/{model}/baseline/score.json"}]
        for b in BRANCHES:
            if b["model"] == model:
                run = f"results/{model}/seq{b['tag']}"
                arms.append({"name": arm_name(b), "score": f"{run}/finetuned/score.json",
                             "train_summary": f"{run}/adapter/train_summary.json"})
        return arms


    if BUCKETS:

        rule compare_arms:
            input:
                data="results/{model}/data/test.jsonl",
                scores=lambda w: [a["score"] for a in arms_of(w.model)],
                adapters=lambda w: [f"results/{w.model}/seq{b['tag']}/adapter"
                                    for b in BRANCHES if b["model"] == w.model],
            output:
                json="results/{model}_by_length.json",
                markdown="results/{model}_by_length.md",
                table=report(
                    "results/{model}_by_length.html",
                    category="Scores",
                    labels={"model": "{model}", "table": "arms by conversation length"},
                ),
            params:
                arms=lambda w: json.dumps(arms_of(w.model)),
                buckets=",".join(str(int(edge)) for edge in BUCKETS),
            log:
                "results/logs/{model}/compare_arms.log",
            benchmark:
                "results/benchmarks/{model}/compare_arms.tsv"
            threads: 1
            resources:
                mem_mb=1000,
            shell:
                "segback compare --data {input.data} --arms {params.arms:q}"
                " --buckets {params.buckets} --out {output.json} --markdown {output.markdown}"
                " --table {output.table} > {log} 2>&1"


    # The sweep's table: one row per branch (score, valid-JSON rate, peak memory, training time),
    # and with eval.length_buckets each model's arms by conversation length.
    rule sweep_summary:
        input:
            [f"results/{b['model']}/seq{b['tag']}/chunk_score.json" for b in BRANCHES],
            **({"by_length": [f"results/{m}_by_length.json" for m in MODELS]} if BUCKETS else {}),
        output:
            json="results/sweep_summary.json",
            markdown="results/sweep_summary.md",
            table=report(
                "results/sweep_summary.html",
                category="Scores",
                labels={"model": "all branches", "table": "sweep summary"},
            ),
        params:
            branches=json.dumps(
                [
                    {k: b[k] for k in BRANCH_KEYS}
                    | {"result": f"results/{b['model']}/seq{b['tag']}/chunk_score.json"}
                    for b in BRANCHES
                ]
            ),
        log:
            "results/logs/sweep_summary.log",
        benchmark:
            "results/benchmarks/sweep_summary.tsv"
        threads: 1
        resources:
            mem_mb=1000,
        shell:
            "segback summarize --sweep {params.branches:q} --out {output.json}"
            + (" $(printf -- '--by-length %s ' {input.by_length})" if BUCKETS else "")
            + " --markdown {output.markdown} --table {output.table} > {log} 2>&1"
