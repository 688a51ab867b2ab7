"""MLX_MAX_OPS_PER_BUFFER: segback's CUDA default for its own work, a user's setting wins, and
the bench runs mlx-lm's modes as mlx-lm ships."""

import argparse

import mlx.core as mx

from segback.benchmark import cli as bench
from segback.backend.ops_per_buffer import CUDA_DEFAULT, ENV, limit_ops_per_buffer


def test_user_setting_wins():
    env = {ENV: "12"}
    assert limit_ops_per_buffer(env) == "12"
    assert env == {ENV: "12"}


def test_cuda_only():
    env: dict[str, str] = {}
    got = limit_ops_per_buffer(env)
    if mx.cuda.is_available():
        assert got == str(CUDA_DEFAULT) and env == {ENV: got}
    else:
        assert got is None and env == {}


def test_bench_flag_reaches_every_mode_and_the_default_only_segback(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    flag = argparse.Namespace(max_ops_per_buffer=7)
    assert bench._mode_env(flag, "ckpt")[ENV] == "7"
    assert bench._mode_env(flag, "segmented")[ENV] == "7"
    unset = argparse.Namespace(max_ops_per_buffer=None)
    assert ENV not in bench._mode_env(unset, "ckpt")
    assert bench._mode_env(unset, "segmented").get(ENV) == (
        str(CUDA_DEFAULT) if mx.cuda.is_available() else None)
    monkeypatch.setenv(ENV, "9")
    assert bench._mode_env(unset, "ckpt")[ENV] == "9"
    assert bench._mode_env(unset, "segmented")[ENV] == "9"
