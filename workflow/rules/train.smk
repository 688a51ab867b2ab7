# Plan segments for the training length, train the LoRA adapter with segmented backward, and
# export it (mlx-lm layout + PEFT). All outputs live under the branch's directory
# {RUN}/seq{seq}/ (RUN: results/{model}, or results/{model}/{dataset.name} for task: generic),
# where the `seq` wildcard is the case length, followed by `-w{window}` for a branch trained on
# windows of the cases (train.window) and `-r{rank}` when train.lora_rank is swept (common.smk:
# seq_len is the training length, the window where there is one; data_tag, lora_rank).


rule plan_segments:
    input:
        model="results/{model}/model",
    output:
        report(
            RUN + "/seq{seq}/plan.json",
            caption="../report/plan.rst",
            category="Training",
            labels={"model": "{model}", "seq": "{seq}", "figure": "segment plan"},
        ),
    params:
        seq=seq_len,
        batch=lambda w: batch_size(w) // RANKS,  # each rank's rows: batch_size is global
        lora_rank=lora_rank,
        lora_layers=opt(
            "--lora-layers", None if TRAIN["num_layers"] == -1 else TRAIN["num_layers"]
        ),
        target_gb=opt("--target-gb", TRAIN["target_gb"]),
        time_budget=opt("--time-budget", TRAIN["time_budget"]),
        measure=TRAIN.get("measure_plan", "auto"),  # "auto" or a count >= 0; absent: auto
        attention=TRAIN["attention"],
        tile=opt("--tile", TRAIN["tile"]),
        offload=opt("--offload", TRAIN["offload"] or None),
    log:
        LOGS + "/seq{seq}/plan_segments.log",
    benchmark:
        BENCH + "/seq{seq}/plan_segments.tsv"
    threads: HEAVY_THREADS
    resources:
        mem_mb=MEM_MB,
        gpu=GPU,
    shell:
        "segback plan --model {input.model} --seq {params.seq} --batch {params.batch}"
        " --lora-rank {params.lora_rank} {params.lora_layers} {params.target_gb}"
        " {params.time_budget} --measure {params.measure} --attention {params.attention}"
        " {params.tile} {params.offload} --out {output} > {log} 2>&1"


rule train_lora:
    input:
        model="results/{model}/model",
        train=lambda w: f"{run_dir(w.model)}/seq{data_tag(w)}/data/train.jsonl",
        valid=lambda w: f"{run_dir(w.model)}/seq{data_tag(w)}/data/valid.jsonl",
        plan=lambda w: plan_file(w.model, w.seq),
    output:
        adapter=directory(RUN + "/seq{seq}/adapter"),
        log=RUN + "/seq{seq}/train_log.jsonl",
    params:
        data=lambda w, input: os.path.dirname(input.train),
        seq=seq_len,
        iters=TRAIN["iters"],
        batch_size=batch_size,  # windows: train.window_batch_size
        grad_accumulation_steps=TRAIN["grad_accum"],
        learning_rate=TRAIN["learning_rate"],
        warmup=TRAIN["warmup"],
        lora_rank=lora_rank,
        lora_scale=TRAIN["lora_scale"],
        lora_dropout=TRAIN["lora_dropout"],
        num_layers=TRAIN["num_layers"],
        steps_per_eval=TRAIN["val_every"],
        val_batches=opt("--val-batches", TRAIN.get("val_batches")),
        save_every=TRAIN["save_every"],
        seed=TRAIN["seed"],
        compile=TRAIN.get("compile", "auto"),  # auto, on/off or true/false: the trainer reads each
        # Resumable state lives where Snakemake does not own it: an interrupted or failed job's
        # outputs are deleted, its checkpoints are not, and the same command resumes from them
        # (settings changed since: a fresh start).
        work=RUN + "/seq{seq}/train_work",
        clean="" if TRAIN.get("keep_checkpoints") else "--clean-checkpoints",
    log:
        LOGS + "/seq{seq}/train_lora.log",
    benchmark:
        BENCH + "/seq{seq}/train_lora.tsv"
    # train.ranks > 1: the launcher's ranks share these threads; one GPU per rank (nccl).
    threads: HEAVY_THREADS
    resources:
        mem_mb=MEM_MB,
        gpu=GPU * RANKS,
    shell:
        "".join(
            (
                train_command(),  # `segback train`, or its launch when train.ranks > 1
                " --train --model {input.model} --data {params.data}"
                " --adapter-path {output.adapter} --plan {input.plan} --max-seq-length {params.seq}"
                " --iters {params.iters} --batch-size {params.batch_size}"
                " --grad-accumulation-steps {params.grad_accumulation_steps}"
                " --learning-rate {params.learning_rate} --warmup {params.warmup}"
                " --fine-tune-type lora --lora-rank {params.lora_rank}"
                " --lora-scale {params.lora_scale} --lora-dropout {params.lora_dropout}"
                " --num-layers {params.num_layers} " + MASK_PROMPT_FLAG +  # chunking: on
                " --steps-per-eval {params.steps_per_eval} {params.val_batches}"
                " --save-every {params.save_every}"
                " --seed {params.seed} --compile {params.compile}"
                " --checkpoint-dir {params.work}/checkpoints --restart-on-change {params.clean}"
                " --parent-pid $PPID"  # an orphaned trainer (Snakemake killed alone) stops
                " --log {params.work}/train_log.jsonl > {log} 2>&1",
                launch_check(),  # "" for one process
                " && cp {params.work}/train_log.jsonl {output.log}",
            )
        )


rule export_adapter:
    input:
        model="results/{model}/model",
        adapter=RUN + "/seq{seq}/adapter",
    output:
        directory(RUN + "/seq{seq}/export"),
    log:
        LOGS + "/seq{seq}/export_adapter.log",
    benchmark:
        BENCH + "/seq{seq}/export_adapter.tsv"
    threads: 1
    resources:
        mem_mb=MEM_MB,
    shell:
        "segback export --model {input.model} --adapter {input.adapter} --out {output}"
        " > {log} 2>&1"
