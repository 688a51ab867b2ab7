# task: generic — the same DAG on the user's own data (config `dataset`) instead of the chunking
# builder: the data is read where it is (a local directory or file, or a Hugging Face dataset;
# a missing valid/test split is carved out of train), filtered by tokens with each model's
# tokenizer (test at eval.max_prompt_tokens, train/valid at `seq`), and evaluated by held-out
# test loss and perplexity (`segback evaluate`) of the stock model (baseline_eval) and with the
# exported adapter (finetuned_eval); with `dataset.scorer` the answers to the test prompts are
# also generated and scored, as in the chunking experiment. Planning, training, export, plots
# and config stamps are the shared rules (train.smk, results.smk), under RUN =
# results/{model}/{dataset.name}. The result is results/{model}_{name}_eval.json, validated
# against segback/experiment/generic_result.schema.json.


def dataset_source():
    """The `--data` of `segback evaluate`: the local path, the Hub name, or an hf_dataset
    config as JSON."""
    if "path" in DATASET:
        return DATASET["path"]
    hf = DATASET["hf"]
    return hf if isinstance(hf, str) else json.dumps(hf, sort_keys=True)


def dataset_inputs(split=None):
    """An input function: the local file a split is read from (its own {split}.jsonl, or
    train.jsonl when it is carved out of train), so that editing it re-runs that split's filter;
    a Hub dataset has none (its name and options are params). `split`: None for the wildcard."""

    def inputs(wildcards):
        if "path" not in DATASET:
            return []
        path = DATASET["path"]
        if not os.path.isdir(path):
            return [path]
        own = os.path.join(path, f"{split or wildcards.split}.jsonl")
        train = os.path.join(path, "train.jsonl")
        return [own] if os.path.exists(own) else [train] if os.path.exists(train) else [path]

    return inputs


def format_flags():
    """mask_prompt and the field names, as `segback evaluate` options (defaults left out)."""
    flags = [] if DATASET["mask_prompt"] else ["--no-mask-prompt"]
    for key in ("prompt_feature", "completion_feature", "chat_feature", "text_feature"):
        if DATASET[key] != DATASET_DEFAULTS[key]:
            flags.append(f"--{key.replace('_', '-')} {shlex.quote(DATASET[key])}")
    return " ".join(flags)


# How a split the source lacks is carved out of train (the same rows for every call).
CARVE_FLAGS = (
    f"--valid-fraction {DATASET['valid_fraction']} --test-fraction {DATASET['test_fraction']}"
    f" --seed {DATASET['seed']}"
)


rule filter_test:
    input:
        model="results/{model}/model",
        data=dataset_inputs("test"),
    output:
        data=RUN + "/data/test.jsonl",
        report=RUN + "/data/test.report.json",
    params:
        source=dataset_source(),
        max_tokens=EVAL["max_prompt_tokens"],
        format=format_flags(),
        carve=CARVE_FLAGS,
    log:
        LOGS + "/filter_test.log",
    benchmark:
        BENCH + "/filter_test.tsv"
    threads: 1
    resources:
        mem_mb=MEM_MB,
    shell:
        "segback evaluate --model {input.model} --data {params.source:q} --split test"
        " --max-tokens {params.max_tokens} {params.format} {params.carve}"
        " --rows {output.data} --out {output.report} > {log} 2>&1"


rule filter_data:
    wildcard_constraints:
        seq=r"\d+",  # a training length: the filtered data does not depend on the LoRA rank
    input:
        model="results/{model}/model",
        data=dataset_inputs(),
    output:
        data=RUN + "/seq{seq}/data/{split}.jsonl",
        report=RUN + "/seq{seq}/data/{split}.report.json",
    params:
        source=dataset_source(),
        max_tokens=lambda w: int(w.seq),
        format=format_flags(),
        carve=CARVE_FLAGS,
    log:
        LOGS + "/seq{seq}/filter_data_{split}.log",
    benchmark:
        BENCH + "/seq{seq}/filter_data_{split}.tsv"
    threads: 1
    resources:
        mem_mb=MEM_MB,
    shell:
        "segback evaluate --model {input.model} --data {params.source:q} --split {wildcards.split}"
        " --max-tokens {params.max_tokens} {params.format} {params.carve}"
        " --rows {output.data} --out {output.report} > {log} 2>&1"


# Held-out loss and perplexity on the filtered test set: the stock model (independent of `seq`)
# and with the exported mlx-lm adapter. The rows are written with the standard field names, so
# only mask_prompt is passed on.
rule baseline_eval:
    input:
        model="results/{model}/model",
        data=RUN + "/data/test.jsonl",
    output:
        RUN + "/baseline/eval.json",
    params:
        max_len=EVAL["max_prompt_tokens"],
        batch_size=EVAL.get("batch_size", 1),
        mask=MASK_PROMPT_FLAG,
    log:
        LOGS + "/baseline_eval.log",
    benchmark:
        BENCH + "/baseline_eval.tsv"
    threads: HEAVY_THREADS
    resources:
        mem_mb=MEM_MB,
        gpu=GPU,
    shell:
        "segback evaluate --model {input.model} --data {input.data}"
        " --max-seq-length {params.max_len} --batch-size {params.batch_size} {params.mask}"
        " --out {output} > {log} 2>&1"


rule finetuned_eval:
    input:
        model="results/{model}/model",
        export=RUN + "/seq{seq}/export",
        data=RUN + "/data/test.jsonl",
    output:
        RUN + "/seq{seq}/finetuned/eval.json",
    params:
        adapter=lambda w, input: os.path.join(input.export, "mlx"),
        max_len=EVAL["max_prompt_tokens"],
        batch_size=EVAL.get("batch_size", 1),
        mask=MASK_PROMPT_FLAG,
    log:
        LOGS + "/seq{seq}/finetuned_eval.log",
    benchmark:
        BENCH + "/seq{seq}/finetuned_eval.tsv"
    threads: HEAVY_THREADS
    resources:
        mem_mb=MEM_MB,
        gpu=GPU,
    shell:
        "segback evaluate --model {input.model} --adapter {params.adapter} --data {input.data}"
        " --max-seq-length {params.max_len} --batch-size {params.batch_size} {params.mask}"
        " --out {output} > {log} 2>&1"


# dataset.scorer: greedy answers to the test prompts, before and after, scored as in the
# chunking experiment (the rows must be what that scorer reads).
if SCORER:

    rule baseline_generate:
        input:
            model="results/{model}/model",
            data=RUN + "/data/test.jsonl",
        output:
            RUN + "/baseline/predictions.jsonl",
        params:
            max_new_tokens=EVAL["max_new_tokens"],
            **GENERATE_PARAMS,
        log:
            LOGS + "/baseline_generate.log",
        benchmark:
            BENCH + "/baseline_generate.tsv"
        threads: HEAVY_THREADS
        resources:
            mem_mb=MEM_MB,
            gpu=GPU,
        shell:
            "segback generate --model {input.model} --data {input.data} --out {output}"
            " --max-tokens {params.max_new_tokens}" + GENERATE_FLAGS + " > {log} 2>&1"

    rule finetuned_generate:
        input:
            model="results/{model}/model",
            export=RUN + "/seq{seq}/export",
            data=RUN + "/data/test.jsonl",
        output:
            RUN + "/seq{seq}/finetuned/predictions.jsonl",
        params:
            adapter=lambda w, input: os.path.join(input.export, "mlx"),
            max_new_tokens=EVAL["max_new_tokens"],
            **GENERATE_PARAMS,
        log:
            LOGS + "/seq{seq}/finetuned_generate.log",
        benchmark:
            BENCH + "/seq{seq}/finetuned_generate.tsv"
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
            data=RUN + "/data/test.jsonl",
            pred=RUN + "/{variant}/predictions.jsonl",
        output:
            RUN + "/{variant}/score.json",
        log:
            LOGS + "/{variant}/score.log",
        benchmark:
            BENCH + "/{variant}/score.tsv"
        threads: 1
        resources:
            mem_mb=2000,
        shell:
            "segback score --data {input.data} --pred {input.pred} --out {output} > {log} 2>&1"


def generic_scores(wildcards):
    """The scorer's score files behind a result (none without a scorer)."""
    if not SCORER:
        return []
    run = run_dir(wildcards.model)
    return [f"{run}/baseline/score.json", f"{run}/seq{wildcard_tag(wildcards)}/finetuned/score.json"]


def generic_score_flags(wildcards, input):
    if not SCORER:
        return ""
    base, tuned = input.scores
    return f"--scorer {SCORER} --baseline {shlex.quote(base)} --finetuned {shlex.quote(tuned)}"


rule summarize:
    input:
        stamps=lambda w: stamp_files(w.model, w.seq if "seq" in w.keys() else None),
        schema=os.path.join(workflow.basedir, "segback/experiment/generic_result.schema.json"),
        baseline=RUN + "/baseline/eval.json",
        finetuned=lambda w: f"{run_dir(w.model)}/seq{wildcard_tag(w)}/finetuned/eval.json",
        scores=generic_scores,
        adapter=lambda w: f"{run_dir(w.model)}/seq{wildcard_tag(w)}/adapter",
        plan=lambda w: plan_file(w.model, wildcard_tag(w)),
        loss=lambda w: f"{run_dir(w.model)}/seq{wildcard_tag(w)}/plots/loss.png",
        memory=lambda w: f"{run_dir(w.model)}/seq{wildcard_tag(w)}/plots/memory.png",
    output:
        json=report(
            "results/{model}_" + NAME + "_eval.json",
            category="Scores",
            labels={"model": "{model}", "table": "result JSON"},
        ),
        table=report(
            "results/{model}_" + NAME + "_eval.html",
            category="Scores",
            labels={"model": "{model}", "table": "test loss, baseline vs fine-tuned"},
        ),
    params:
        dataset=NAME,
        scores=generic_score_flags,
        train_summary=lambda w, input: os.path.join(input.adapter, "train_summary.json"),
        benchmarks=lambda w: benchmark_files(w.model, wildcard_tag(w)),
    log:
        LOGS + "/summarize.log",
    benchmark:
        BENCH + "/summarize.tsv"
    threads: 1
    resources:
        mem_mb=1000,
    shell:
        "segback summarize --task generic --model-name {wildcards.model}"
        " --dataset {params.dataset} --baseline-eval {input.baseline}"
        " --finetuned-eval {input.finetuned} {params.scores}"
        " --train-summary {params.train_summary} --plan {input.plan} --schema {input.schema}"
        " --benchmarks {params.benchmarks}"
        " --artifact loss_plot={input.loss} --artifact memory_plot={input.memory}"
        " $(printf -- '--stamp %s ' {input.stamps})"
        " --out {output.json} --table {output.table} > {log} 2>&1"


# One sweep branch's result: the same summary, for the branch named by its path.
use rule summarize as summarize_branch with:
    output:
        json=report(
            RUN + "/seq{seq}/" + BRANCH_RESULT + ".json",
            category="Scores",
            labels={"model": "{model}", "seq": "{seq}", "table": "result JSON"},
        ),
        table=report(
            RUN + "/seq{seq}/" + BRANCH_RESULT + ".html",
            category="Scores",
            labels={"model": "{model}", "seq": "{seq}", "table": "test loss"},
        ),
    log:
        LOGS + "/seq{seq}/summarize.log",
    benchmark:
        BENCH + "/seq{seq}/summarize.tsv"


# The sweep's table: one row per branch (test loss and perplexity, peak memory, training time).
rule sweep_summary:
    input:
        [f"{run_dir(b['model'])}/seq{b['tag']}/{BRANCH_RESULT}.json" for b in BRANCHES],
    output:
        json=SWEEP_TABLE + ".json",
        markdown=SWEEP_TABLE + ".md",
        table=report(
            SWEEP_TABLE + ".html",
            category="Scores",
            labels={"model": "all branches", "table": "sweep summary"},
        ),
    params:
        branches=json.dumps(
            [
                {k: b[k] for k in ("model", "seq", "lora_rank")}
                | {"result": f"{run_dir(b['model'])}/seq{b['tag']}/{BRANCH_RESULT}.json"}
                for b in BRANCHES
            ]
        ),
    log:
        f"results/logs/{NAME}_sweep_summary.log",
    benchmark:
        f"results/benchmarks/{NAME}_sweep_summary.tsv"
    threads: 1
    resources:
        mem_mb=1000,
    shell:
        "segback summarize --task generic --sweep {params.branches:q} --out {output.json}"
        " --markdown {output.markdown} --table {output.table} > {log} 2>&1"
