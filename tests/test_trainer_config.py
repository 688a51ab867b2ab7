"""`segback train`'s options: mlx-lm's names and config files, precedence, checks at the edge."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from segback.trainer import cli
from segback.trainer.arguments import from_args
from segback.trainer.config import OPTIMIZERS, TrainConfigError, TrainConfig

MLX_LM_CONFIG = Path(__file__).parent / "data" / "mlx_lm_lora_config.yaml"
KEYS = ["self_attn.q_proj", "self_attn.v_proj"]


def parse(argv: list[str]) -> TrainConfig:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return from_args(p.parse_args(argv))


def test_mlx_lm_example_config_parses_to_its_settings():
    cfg = parse(["-c", str(MLX_LM_CONFIG), "--model", "X", "--data", "Y"])
    assert (cfg.model, cfg.data, cfg.train, cfg.do_train) == ("X", "Y", True, True)
    assert (cfg.fine_tune_type, cfg.optimizer, cfg.training_mode) == ("lora", "adamw", "normal")
    assert (cfg.seed, cfg.num_layers, cfg.batch_size, cfg.iters) == (0, 16, 4, 1000)
    assert cfg.learning_rate == 1e-5 and isinstance(cfg.learning_rate, float)
    assert (cfg.val_batches, cfg.steps_per_report, cfg.steps_per_eval) == (25, 10, 200)
    assert (cfg.resume_adapter_file, cfg.adapter_path, cfg.save_every) == (None, "adapters", 100)
    assert (cfg.test, cfg.test_batches, cfg.max_seq_length) == (False, 100, 2048)
    assert cfg.grad_checkpoint is False
    assert cfg.lora_parameters == {"keys": KEYS, "rank": 8, "scale": 20.0, "dropout": 0.0}


def test_mlx_lm_optimizer_config_and_lr_schedule(tmp_path):
    """The example's commented-out blocks, uncommented: mlx-lm's optimizer and schedule."""
    import mlx.core as mx
    import mlx.optimizers as optim

    text = MLX_LM_CONFIG.read_text()
    for line in ("# optimizer_config:", "#   adamw:", "#     betas", "#     eps",
                 "#     weight_decay", "#     bias_correction", "#lr_schedule:", "#  name",
                 "#  warmup", "#  arguments"):
        text = text.replace(line, line.replace("# ", "", 1).replace("#", "", 1))
    (tmp_path / "c.yaml").write_text(text)
    cfg = parse(["-c", str(tmp_path / "c.yaml"), "--model", "X", "--data", "Y"])
    assert cfg.optimizer_config == {"adamw": {"betas": [0.9, 0.98], "eps": 1e-6,
                                              "weight_decay": 0.05, "bias_correction": True}}
    assert cfg.lr_schedule == {"name": "cosine_decay", "warmup": 100, "warmup_init": 1e-7,
                               "arguments": [1e-5, 1000, 1e-7]}
    opt = cli.build_optimizer(cfg)
    assert type(opt) is optim.AdamW and opt.weight_decay == 0.05 and opt.eps == 1e-6
    sched = opt._schedulers["learning_rate"]
    assert sched(mx.array(0)).item() == pytest.approx(1e-7)
    assert sched(mx.array(100)).item() == pytest.approx(1e-5)
    assert sched(mx.array(5000)).item() == pytest.approx(1e-7)


def test_every_mlx_lm_option_is_accepted():
    """Each flag of mlx_lm.lora is a flag here, each of its config keys a key here, and the
    optimizer and fine-tune choices are its own."""
    from mlx_lm import lora

    ours = argparse.ArgumentParser()
    cli.add_arguments(ours)
    flags = {s for a in ours._actions for s in a.option_strings}
    theirs = lora.build_parser()._actions
    assert {s for a in theirs for s in a.option_strings} <= flags
    choices = {a.dest: a.choices for a in theirs if a.choices}
    assert tuple(choices["optimizer"]) == OPTIMIZERS == tuple(lora.CONFIG_DEFAULTS[
        "optimizer_config"])
    assert tuple(choices["fine_tune_type"]) == ("lora", "dora", "full")
    cfg = TrainConfig.from_dict(lora.CONFIG_DEFAULTS | {"train": True})  # values we run
    assert cfg.optimizer == "adam" and cfg.num_layers == 16 and cfg.lr_schedule is None


def test_flags_override_the_config_file():
    cfg = parse(["-c", str(MLX_LM_CONFIG), "--model", "X", "--data", "Y", "--batch-size", "2",
                 "--learning-rate", "3e-4", "--lora-rank", "4", "--no-mask-prompt", "--seq",
                 "128", "--grad-accum", "3", "--val-every", "7", "--optimizer", "sgd",
                 "--weight-decay", "0.1", "--tile", "64", "--compile", "off"])
    assert (cfg.batch_size, cfg.learning_rate, cfg.mask_prompt) == (2, 3e-4, False)
    assert (cfg.max_seq_length, cfg.grad_accumulation_steps, cfg.steps_per_eval) == (128, 3, 7)
    assert cfg.lora_parameters == {"keys": KEYS, "rank": 4, "scale": 20.0, "dropout": 0.0}
    assert cfg.optimizer_config == {"sgd": {"weight_decay": 0.1}}
    assert cfg.engine == {"tile": 64, "compile": False}  # typed once, here
    assert cli.build_optimizer(cfg).weight_decay == 0.1


@pytest.mark.parametrize("argv, message", [
    (["--learning-rate", "-1"], r"learning_rate \(--learning-rate\) -1.0: must be > 0"),
    (["--warmup", "-3"], r"warmup \(--warmup\) -3: must be >= 0"),
    (["--lora-rank", "0"], r"lora_rank \(--lora-rank\) 0: must be >= 1"),
    (["--iters", "0"], r"iters \(--iters\) 0: must be >= 1"),
    (["--batch-size", "0"], r"batch_size \(--batch-size\) 0: must be >= 1"),
    (["--num-layers", "0"], r"num_layers .* 0: must be >= 1, or -1 \(-1 means all layers\)"),
    (["--lora-dropout", "1.5"], r"lora_parameters.dropout .* must be in \[0, 1\)"),
    (["--max-seq-length", "lots"], r"max_seq_length .* must be a number, not 'lots'"),
    (["--tile", "big"], r"tile must be a whole number, not 'big'"),
    (["--attention", "chunked", "--boundaries-on-device", "2"], r"needs offload=true"),
    (["--measure-plan", "-2"], r"measure_plan \(--measure-plan\) must be auto or a whole "
                               r"number >= 0, not '-2'"),
    (["--measure-plan", "some"], r"measure_plan .* must be auto or a whole number >= 0, not "
                                 r"'some'"),
    (["--weight-decay", "0.1"], None),  # Adam has none: refused when the optimizer is built
])
def test_bad_values_are_refused_with_the_option_named(argv, message):
    if message is None:
        with pytest.raises(TrainConfigError, match="Adam has no weight_decay"):
            cli.build_optimizer(parse(["--model", "m", "--data", "d", *argv]))
        return
    with pytest.raises(TrainConfigError, match=message):
        parse(["--model", "m", "--data", "d", *argv])


def test_config_file_values_and_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text('learning_rate: "1e-5"\nlora_parameters: {rank: 0, scale: 1.0}\n')
    with pytest.raises(TrainConfigError, match=r"lora_parameters.rank \(--lora-rank\) 0"):
        parse(["-c", str(path), "--model", "m", "--data", "d"])
    cfg = parse(["-c", str(path), "--model", "m", "--data", "d", "--lora-rank", "2"])
    assert cfg.learning_rate == 1e-5 and cfg.lora_parameters["rank"] == 2  # "1e-5": a float
    assert TrainConfig.from_dict({"learning_rate": "2e-4"}).learning_rate == 2e-4

    path.write_text("learning_rat: 1e-5\n")
    with pytest.raises(TrainConfigError, match=r"unknown option 'learning_rat'; did you mean "
                                          r"'learning_rate'\?$"):
        parse(["-c", str(path), "--model", "m", "--data", "d"])
    path.write_text("lora_parameters: {rank: 8, alpha: 16}\n")
    with pytest.raises(TrainConfigError, match="uses 'scale'"):
        parse(["-c", str(path), "--model", "m", "--data", "d"])
    path.write_text("lr_schedule: {name: cosine_decay, argumnets: [1, 2]}\n")
    with pytest.raises(TrainConfigError, match="did you mean 'arguments'"):
        parse(["-c", str(path), "--model", "m", "--data", "d"])
    path.write_text("training_mode: dpo\n")
    with pytest.raises(TrainConfigError, match="training_mode 'dpo' is not supported.*mlx-lm-lora"):
        parse(["-c", str(path), "--model", "m", "--data", "d"])
    with pytest.raises(TrainConfigError, match="trust_remote_code is not supported"):
        parse(["--model", "m", "--data", "d", "--trust-remote-code"])
    with pytest.raises(TrainConfigError, match="missing option.*--data"):
        parse(["--model", "m"])
    with pytest.raises(TrainConfigError, match="nothing to do"):
        parse(["--model", "m", "--data", "d", "--no-train"])
    assert parse(["--model", "m", "--data", "d", "--test"]).do_train is False  # as mlx-lm
    assert parse(["--model", "m", "--data", "d", "--test", "--train"]).do_train is True


def test_cli_reports_config_errors_in_one_line(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("model: m\ndata: d\nbatch_sise: 2\n")
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.main(p.parse_args(["-c", str(tmp_path / "c.yaml")])) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("unknown option 'batch_sise'; did you mean 'batch_size'?")
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_adapter_configs_are_config_files(tmp_path):
    """An adapter_config.json from segback or from mlx_lm.lora (its arguments) loads with -c."""
    from mlx_lm import lora

    ours = TrainConfig.from_dict(dict(model="m", data="d", lora_rank=4, lora_keys=KEYS,
                                      tile="64", plan=2, warmup=3))
    (tmp_path / "ours.json").write_text(json.dumps(ours.to_dict()))
    assert parse(["-c", str(tmp_path / "ours.json")]) == ours
    theirs = {**lora.CONFIG_DEFAULTS, "config": "lora.yaml", "model": "m", "data": "d",
              "train": True, "fine_tune_type": "full", "lora_parameters": None,
              "trust_remote_code": False}
    (tmp_path / "theirs.json").write_text(json.dumps(theirs))
    cfg = parse(["-c", str(tmp_path / "theirs.json")])
    assert cfg.fine_tune_type == "full" and cfg.learning_rate == 1e-5 and cfg.num_layers == 16


def test_report_to_uses_mlx_lm_callbacks_or_says_what_is_missing():
    cfg = parse(["--model", "m", "--data", "d", "--report-to", "wandb", "--project-name", "p"])
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(TrainConfigError, match="--report-to wandb: wandb is not installed"):
            cli.reporting_callback(cfg)
    else:
        pytest.skip("wandb is installed: the callback would start a run")
    with pytest.raises(ValueError, match="tensorboard callback doesn't exist"):
        cli.reporting_callback(parse(["--model", "m", "--data", "d", "--report-to",
                                      "tensorboard"]))


def test_workflow_train_rule_is_checked_against_the_declaration(tmp_path):
    """The flags the workflow's train_lora rule passes are all declared options of `segback
    train` with valid values (the rule is checked against the one declaration)."""
    import argparse
    import re
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    from segback.trainer.arguments import add_arguments, from_args

    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile",
                          str(repo / "Snakefile"), "--directory", str(tmp_path), "-n", "-p",
                          "--cores", "2", "--configfile", str(repo / "config" / "config.yaml"),
                          "--", "results/gemma3/seq2048/adapter"],
                         capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if re.search(r"(^|: )segback train ", x))
    argv = shlex.split(line.split("segback train ", 1)[1].split(">")[0]
                       .replace("$PPID", "4321"))  # as the job's shell expands it
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = from_args(parser.parse_args(argv))
    train = yaml.safe_load((repo / "config" / "config.yaml").read_text())["train"]
    assert cfg.iters == train["iters"] and cfg.val_batches == train["val_batches"]
    assert cfg.steps_per_eval == train["val_every"]
    assert cfg.max_seq_length == 2048 and cfg.mask_prompt
    assert cfg.checkpoint_dir.endswith("train_work/checkpoints") and cfg.restart_on_change
    assert cfg.parent_pid == 4321  # the trainer stops when its Snakemake is gone


def test_measure_plan_takes_auto_or_a_count():
    assert parse(["--model", "m", "--data", "d"]).measure_plan == "auto"
    assert parse(["--model", "m", "--data", "d", "--measure-plan", "AUTO"]).measure_plan == "auto"
    assert parse(["--model", "m", "--data", "d", "--measure-plan", "4"]).measure_plan == 4


def test_engine_options_are_typed_once_by_their_present_names(tmp_path):
    """The command line's strings and a config's values become typed engine options here, by
    their present names (old ones read); AUTO stays where the planner chooses, and 'auto' for a
    device default is that default."""
    from segback.engine.options import AUTO
    from segback.trainer import engine_request

    cfg = parse(["--model", "m", "--data", "d", "--tile", "auto", "--offload", "Auto",
                 "--compile", "auto", "--tiles-in-flight", "3", "--light-tile", "512"])
    assert cfg.engine == {"tile": AUTO, "offload": AUTO, "tiles_in_flight": 3, "light_tile": 512}
    space = engine_request.space(cfg.engine)
    assert (space.tile, space.offload, space.light_tile) == (AUTO, AUTO, 512)
    assert engine_request.runtime(cfg.engine).tiles_in_flight == 3
    path = tmp_path / "c.yaml"
    path.write_text("offload_keep: 2\nengine: {tile: '64', offload: 'on', head_max_elements: 8}\n")
    cfg = parse(["-c", str(path), "--model", "m", "--data", "d"])
    assert cfg.engine == {"tile": 64, "offload": True, "boundaries_on_device": 2, "head_chunk": 8}
    assert TrainConfig.from_dict(cfg.to_dict()).engine == cfg.engine  # adapter_config.json
    for given, message in (({"attention": "auto"}, "attention has no 'auto'"),
                           ({"tiles_in_flight": "auto"}, "tiles_in_flight has no 'auto'"),
                           ({"tile": "auto", "light_tile": "x"}, "light_tile must be a whole")):
        with pytest.raises(TrainConfigError, match=message):
            TrainConfig.from_dict({"model": "m", "data": "d", **given})
