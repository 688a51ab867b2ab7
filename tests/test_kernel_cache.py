"""MLX's CUDA kernel cache: one directory per MLX version and device; a user's setting wins."""

from pathlib import Path

import mlx.core as mx

from segback.backend.kernel_cache import ENV, kernel_cache_dir, persist_kernel_cache


def test_directory_is_per_version_and_device():
    a = kernel_cache_dir(Path("/c"), "0.32.4", "NVIDIA H200")
    b = kernel_cache_dir(Path("/c"), "0.32.4", "NVIDIA H100 80GB HBM3")
    assert a == Path("/c/mlx-kernels/0.32.4-nvidia-h200")
    assert b == Path("/c/mlx-kernels/0.32.4-nvidia-h100-80gb-hbm3")
    assert kernel_cache_dir(Path("/c"), "1", "///") == Path("/c/mlx-kernels/1-gpu")


def test_user_setting_wins():
    env = {ENV: "/mine"}
    assert persist_kernel_cache(env) == "/mine"
    assert env == {ENV: "/mine"}


def test_cuda_only(tmp_path, monkeypatch):
    monkeypatch.setenv("SEGBACK_CACHE", str(tmp_path))
    env: dict[str, str] = {}
    got = persist_kernel_cache(env)
    if mx.cuda.is_available():
        assert got == env[ENV] and Path(got).is_dir() and Path(got).parent.parent == tmp_path
    else:
        assert got is None and env == {}
