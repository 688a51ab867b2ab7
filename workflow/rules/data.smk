# Dataset: build once (model-independent), then length-filter with each model's tokenizer.
# The test split is filtered at eval.max_prompt_tokens, so the held-out set never depends on
# `seq`; train/valid are filtered at the training length and live under seq{seq}/ (one copy per
# model and length, shared by the branches of a swept train.lora_rank, seq{seq}-r{rank}/).
# data.min_tokens also drops the cases shorter than that from every split (the long-context
# variant, config/long.yaml). A branch trained on windows (train.window) reads its cases cut
# into windows, seq{seq}-w{window}/data/ (window_data).

# `--min-tokens` only where data.min_tokens is set, so configs without it keep their params.
MIN_TOKENS = (
    {"min_tokens": f"--min-tokens {int(DATA['min_tokens'])}"}
    if DATA.get("min_tokens") is not None
    else {}
)
MIN_TOKENS_FLAG = " {params.min_tokens}" if MIN_TOKENS else ""


rule build_dataset:
    output:
        train="results/data/train.jsonl",
        valid="results/data/valid.jsonl",
        test="results/data/test.jsonl",
        stats="results/data/stats.json",
    params:
        out=lambda w, output: os.path.dirname(output.stats),
        seed=DATA["seed"],
        n_train=DATA["n_train"],
        n_valid=DATA["n_valid"],
        n_test=DATA["n_test"],
        min_sources=DATA["min_sources"],
        max_sources=DATA["max_sources"],
        max_turns=DATA["max_turns"],
        max_message_chars=DATA["max_message_chars"],
        label_words=opt("--label-words", DATA.get("label_words")),
        max_reply_chars=opt("--max-reply-chars", DATA.get("max_reply_chars")),
        id_chars=opt("--id-chars", DATA.get("id_chars")),
    log:
        "results/logs/data/build_dataset.log",
    benchmark:
        "results/benchmarks/data/build_dataset.tsv"
    threads: 1
    resources:
        mem_mb=2000,
    shell:
        "segback build-data --out {params.out} --seed {params.seed}"
        " --n-train {params.n_train} --n-valid {params.n_valid} --n-test {params.n_test}"
        " --min-sources {params.min_sources} --max-sources {params.max_sources}"
        " --max-turns {params.max_turns} --max-message-chars {params.max_message_chars}"
        " {params.label_words} {params.max_reply_chars} {params.id_chars} > {log} 2>&1"


rule filter_test:
    input:
        model="results/{model}/model",
        data="results/data/test.jsonl",
    output:
        data="results/{model}/data/test.jsonl",
        report="results/{model}/data/test.report.json",
    params:
        max_tokens=EVAL["max_prompt_tokens"],
        **MIN_TOKENS,
    log:
        "results/logs/{model}/filter_test.log",
    benchmark:
        "results/benchmarks/{model}/filter_test.tsv"
    threads: 1
    resources:
        mem_mb=MEM_MB,
    shell:
        "segback filter-data --model {input.model} --data {input.data}"
        " --max-tokens {params.max_tokens}" + MIN_TOKENS_FLAG + " --out {output.data}"
        " --report {output.report} > {log} 2>&1"


rule filter_data:
    wildcard_constraints:
        seq=r"\d+",  # a training length: the filtered data does not depend on the LoRA rank
    input:
        model="results/{model}/model",
        data="results/data/{split}.jsonl",
    output:
        data="results/{model}/seq{seq}/data/{split}.jsonl",
        report="results/{model}/seq{seq}/data/{split}.report.json",
    params:
        max_tokens=lambda w: int(w.seq),
        **MIN_TOKENS,
    log:
        "results/logs/{model}/seq{seq}/filter_data_{split}.log",
    benchmark:
        "results/benchmarks/{model}/seq{seq}/filter_data_{split}.tsv"
    threads: 1
    resources:
        mem_mb=MEM_MB,
    shell:
        "segback filter-data --model {input.model} --data {input.data}"
        " --max-tokens {params.max_tokens}" + MIN_TOKENS_FLAG + " --out {output.data}"
        " --report {output.report} > {log} 2>&1"


# The cases of a length cut into windows of at most {window} tokens, each window a training
# example whose gold is the chunks inside it (segback/chunking/windows.py): the training data
# of a user whose memory stops at the window.
rule window_data:
    wildcard_constraints:
        seq=r"\d+",
        window=r"\d+",
    input:
        model="results/{model}/model",
        data="results/{model}/seq{seq}/data/{split}.jsonl",
    output:
        data="results/{model}/seq{seq}-w{window}/data/{split}.jsonl",
        report="results/{model}/seq{seq}-w{window}/data/{split}.report.json",
    log:
        "results/logs/{model}/seq{seq}-w{window}/window_data_{split}.log",
    benchmark:
        "results/benchmarks/{model}/seq{seq}-w{window}/window_data_{split}.tsv"
    threads: 1
    resources:
        mem_mb=MEM_MB,
    shell:
        "segback window-data --model {input.model} --data {input.data} --window {wildcards.window}"
        " --out {output.data} --report {output.report} > {log} 2>&1"
