"""Bad inputs and bad environments: a silent Hub endpoint, adapters that do not fit (rank, other
architecture, NaN, truncated, missing config), killed and failed atomic writes (stale scratch,
a full disk), and the base-model id a PEFT export records. No network: the "Hub" is a local
socket that accepts connections and never answers."""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import save_config, save_model
from test_adapters import INPUT, make_adapter, make_model_dir

from segback.models import export as exp
from segback import io as sio
from segback.models.adapters import (
    AdapterError,
    adapter_modules,
    mount,
    save_safetensors_atomic,
)
from segback.models import prepare as prep
from segback.models.random_init import build_model, geometry_config
from segback.models.load import load

ROOT = Path(__file__).resolve().parents[1]
HUB_HELP = "Download it on a machine with network access"  # _hub_help's advice, offline or not


# -- 1. a Hub endpoint that accepts the connection and never answers ---------------------------

@pytest.fixture
def silent_hub():
    """A TCP server on localhost that accepts every connection and never sends a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    conns: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conns.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for c in conns:  # a request still waiting (today's code) now sees EOF and ends
        c.close()


def _hub_env(monkeypatch, tmp_path, endpoint: str) -> None:
    import huggingface_hub.constants as hc

    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy",
              "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(hc, "ENDPOINT", endpoint)  # (read at import; the env is for subprocesses)
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "2")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))


def test_silent_hub_endpoint_fails_fast(silent_hub, tmp_path, monkeypatch, capsys):
    from huggingface_hub.utils import get_session

    _hub_env(monkeypatch, tmp_path, silent_hub)
    hooks_before = list(get_session().event_hooks["request"])
    args = prep_args("hub", "segback-test/silent", tmp_path / "hub")
    result: dict = {}

    def run() -> None:
        result["rc"] = prep.main(args)

    start = time.perf_counter()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(15)
    elapsed = time.perf_counter() - start
    assert not worker.is_alive(), "prepare-model hung on an endpoint that never answers"
    assert result["rc"] == 2 and elapsed < 10
    err = capsys.readouterr().err
    assert "did not answer within 2s" in err and silent_hub in err
    assert HUB_HELP in err and "hf download segback-test/silent" in err
    assert "Traceback" not in err and err.count("\n") == 1  # one paragraph
    assert not (tmp_path / "hub").exists() and not list(tmp_path.glob(".hub.*"))
    assert get_session().event_hooks["request"] == hooks_before  # our timeout hook is gone


def test_silent_hub_endpoint_cli(silent_hub, tmp_path):
    """The real command, with HF_ENDPOINT and HF_HUB_ETAG_TIMEOUT in its environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") and "proxy" not in k.lower()}
    env.update(HF_ENDPOINT=silent_hub, HF_HUB_ETAG_TIMEOUT="2", HF_HOME=str(tmp_path / "hf"),
               SEGBACK_BLAS_CHECKED="1")
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "segback.cli", "prepare-model", "--source", "hub",
                        "--ref", "segback-test/silent", "--out", str(tmp_path / "hub")],
                       env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2, p.stderr
    assert time.perf_counter() - start < 30  # (imports included; the Hub wait is 2 s)
    assert "did not answer within 2s" in p.stderr and HUB_HELP in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "hub").exists()


def test_offline_and_silent_share_the_advice(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match=HUB_HELP):
        prep.hub_snapshot("segback-test/not-cached-anywhere")


def prep_args(source, ref, out):
    p = argparse.ArgumentParser()
    prep.add_arguments(p)
    return p.parse_args(["--source", source, "--ref", ref, "--out", str(out)])


# -- 2. adapters that do not fit: export and mount refuse them, writing nothing -----------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def good_adapter(model_dir, tmp_path_factory) -> Path:
    return make_adapter(model_dir, tmp_path_factory.mktemp("ad") / "good", seed=1)


def copy_adapter(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def export_cli(model, adapter, out, *extra) -> int:
    p = argparse.ArgumentParser()
    exp.add_arguments(p)
    return exp.main(p.parse_args(["--model", str(model), "--adapter", str(adapter),
                                  "--out", str(out), *extra]))


def _edit_config(adapter: Path, **changes) -> None:
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    for k, v in changes.items():
        if k == "rank":
            cfg["lora_parameters"]["rank"] = v
        else:
            cfg[k] = v
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))


def _poison(adapter: Path, value: float = float("nan")) -> None:
    w = mx.load(str(adapter / "adapters.safetensors"))
    key = sorted(k for k in w if k.endswith("lora_b"))[0]
    w[key] = mx.full(w[key].shape, value)
    mx.save_safetensors(str(adapter / "adapters.safetensors"), w)


def assert_refused(capsys, rc: int, out: Path, *words: str) -> str:
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and err.startswith("segback export: error: ")
    assert err.count("\n") == 1, err  # one paragraph
    for w in words:
        assert w in err, err
    assert not out.exists() and not [p for p in out.parent.iterdir()
                                      if p.name.startswith(f".{out.name}.")]
    return err


def test_export_refuses_rank_mismatch(model_dir, good_adapter, tmp_path, capsys):
    ad = copy_adapter(good_adapter, tmp_path / "ad")
    _edit_config(ad, rank=8)
    rc = export_cli(model_dir, ad, tmp_path / "exp")
    assert_refused(capsys, rc, tmp_path / "exp", "rank 8", "rank-4", "adapter_config.json")


def test_export_refuses_other_architecture(good_adapter, tmp_path, capsys):
    wider = tmp_path / "wider"  # the same module names, another MLP width: shapes do not fit
    save_model(wider, build_model(geometry_config("tiny-llama", intermediate_size=96)))
    save_config(geometry_config("tiny-llama", intermediate_size=96), wider / "config.json")
    rc = export_cli(wider, good_adapter, tmp_path / "exp")
    assert_refused(capsys, rc, tmp_path / "exp", "shapes", "mlp.", "(96, 4) in the model",
                   "base model")
    # another architecture (gemma4: other head sizes) and one with fewer layers (qwen2: 3 of 4)
    rc = export_cli("tiny-e4b", good_adapter, tmp_path / "exp")
    assert_refused(capsys, rc, tmp_path / "exp", "adapters.safetensors", "k_proj",
                   "another model")
    rc = export_cli("tiny-qwen2", good_adapter, tmp_path / "exp")
    assert_refused(capsys, rc, tmp_path / "exp", "does not have", "model.layers.3.")


def test_export_refuses_nan_weights_and_keeps_previous_out(model_dir, good_adapter, tmp_path,
                                                           capsys):
    out = tmp_path / "exp"
    assert export_cli(model_dir, good_adapter, out) == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    ad = copy_adapter(good_adapter, tmp_path / "ad")
    _poison(ad)
    rc = export_cli(model_dir, ad, out)
    err = capsys.readouterr().err
    assert rc == 2 and "NaN" in err and "Traceback" not in err
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_export_refuses_truncated_weights(model_dir, good_adapter, tmp_path, capsys):
    ad = copy_adapter(good_adapter, tmp_path / "ad")
    data = (ad / "adapters.safetensors").read_bytes()
    (ad / "adapters.safetensors").write_bytes(data[: len(data) // 2])
    rc = export_cli(model_dir, ad, tmp_path / "exp")
    assert_refused(capsys, rc, tmp_path / "exp", "adapters.safetensors", "truncated")


def test_export_refuses_missing_config(model_dir, good_adapter, tmp_path, capsys):
    ad = copy_adapter(good_adapter, tmp_path / "ad")
    (ad / "adapter_config.json").unlink()
    rc = export_cli(model_dir, ad, tmp_path / "exp")
    assert_refused(capsys, rc, tmp_path / "exp", str(ad / "adapter_config.json"), "mlx-lm",
                   "adapters.safetensors")


def test_export_refuses_unreadable_config(model_dir, good_adapter, tmp_path, capsys):
    ad = copy_adapter(good_adapter, tmp_path / "ad")
    (ad / "adapter_config.json").write_text("{not json")
    rc = export_cli(model_dir, ad, tmp_path / "exp")
    assert_refused(capsys, rc, tmp_path / "exp", "adapter_config.json", "JSON")


def test_export_writes_nothing_when_a_late_step_fails(model_dir, good_adapter, tmp_path,
                                                      monkeypatch):
    def boom(*a, **k):
        raise ValueError("fuse failed")

    monkeypatch.setattr(exp, "export_fused", boom)
    with pytest.raises(ValueError, match="fuse failed"):  # after mlx/ and peft/ were built
        exp.export(str(model_dir), good_adapter, tmp_path / "exp", fuse=True)
    assert not (tmp_path / "exp").exists() and not list(tmp_path.glob(".exp.*"))


def test_export_full_disk_names_out_and_keeps_previous(model_dir, good_adapter, tmp_path,
                                                       monkeypatch, capsys):
    out = tmp_path / "exp"
    assert export_cli(model_dir, good_adapter, out, "--no-peft") == 0
    capsys.readouterr()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(exp.shutil, "copy2", full)
    rc = export_cli(model_dir, good_adapter, out)
    err = capsys.readouterr().err
    assert rc == 2 and f"cannot write {out}" in err and "No space left" in err
    assert "Traceback" not in err
    assert (out / "mlx/adapters.safetensors").read_bytes() == \
        (good_adapter / "adapters.safetensors").read_bytes()
    assert not (out / "peft").exists() and not list(tmp_path.glob(".exp.*"))


def test_export_refuses_foreign_out_dir(model_dir, good_adapter, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    rc = export_cli(model_dir, good_adapter, out)
    err = capsys.readouterr().err
    assert rc == 2 and "notes.txt" in err and (out / "notes.txt").read_text() == "keep me"


def test_mount_and_load_refuse_nan_weights(model_dir, good_adapter, tmp_path):
    from mlx_lm.utils import load_model

    ad = copy_adapter(good_adapter, tmp_path / "ad")
    _poison(ad)
    model, _ = load_model(model_dir)
    base = np.array(model(INPUT))
    with pytest.raises(AdapterError, match="NaN"):
        mount(model, ad)
    assert not adapter_modules(model)
    np.testing.assert_array_equal(np.array(model(INPUT)), base)  # left as it was
    with pytest.raises(AdapterError, match="NaN"):  # what `segback generate --adapter` calls
        load(str(model_dir), adapter_path=str(ad))
    _poison(ad, float("inf"))
    with pytest.raises(AdapterError, match="infinite"):
        load("tiny-llama", adapter_path=str(ad))


def test_mount_refuses_rank_mismatch_and_missing_config(model_dir, good_adapter, tmp_path):
    from mlx_lm.utils import load_model

    ad = copy_adapter(good_adapter, tmp_path / "ad")
    _edit_config(ad, rank=2)
    model, _ = load_model(model_dir)
    with pytest.raises(AdapterError, match="rank 2"):
        mount(model, ad)
    (ad / "adapter_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="adapter_config.json.*mlx-lm"):
        mount(model, ad)
    with pytest.raises(AdapterError, match="another model"):
        mount(build_model("tiny-e4b"), good_adapter)


def test_mount_still_matches_mlx_lm(model_dir, good_adapter):
    from mlx_lm import load as mlx_load
    from mlx_lm.utils import load_model

    ref, _ = mlx_load(str(model_dir), adapter_path=str(good_adapter))
    ours, _ = load(str(model_dir), adapter_path=str(good_adapter))
    np.testing.assert_array_equal(np.array(ours(INPUT)), np.array(ref(INPUT)))
    mounted = mount(load_model(model_dir)[0], good_adapter)
    np.testing.assert_array_equal(np.array(mounted(INPUT)), np.array(ref(INPUT)))


# -- 3. atomic writes: stale scratch from killed writers, a full disk ---------------------------

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_killed_write_leaves_scratch_that_the_next_write_removes(tmp_path):
    target = tmp_path / "result.json"
    target.write_text('{"old": true}\n')
    code = ("import os, sys, time; from segback import io\n"
            "os.replace = lambda *a: time.sleep(60)  # killed between write and rename\n"
            f"io.atomic_write_json({str(target)!r}, {{'new': True}})\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    deadline = time.time() + 30
    while not list(tmp_path.glob(".result.json.*.tmp")) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert len(list(tmp_path.glob(".result.json.*.tmp"))) == 1  # the killed write's scratch
    assert json.loads(target.read_text()) == {"old": True}
    sio.atomic_write_json(target, {"next": 1})
    assert json.loads(target.read_text()) == {"next": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_stale_scratch_rules(tmp_path):
    target = tmp_path / "rows.jsonl"
    host, dead = sio._host(), _dead_pid()
    stale = [tmp_path / f".rows.jsonl.{host}.{dead}.0123abcd.tmp",  # killed on this host
             tmp_path / ".rows.jsonl.k3j_x9q2.tmp",  # the former mkstemp naming, old
             tmp_path / f".rows.jsonl.otherhost.{os.getpid()}.0123abcd.tmp"]  # old elsewhere
    live = [tmp_path / f".rows.jsonl.{host}.{os.getpid()}.0123abcd.tmp",  # this process
            tmp_path / f".rows.jsonl.{host}.{os.getppid()}.0123abcd.tmp",  # a live process
            tmp_path / ".rows.jsonl.recent01.tmp",  # former naming, recent: maybe live
            tmp_path / f".other.jsonl.{host}.{dead}.0123abcd.tmp"]  # another target's
    old = time.time() - 2 * sio.STALE_AFTER_S
    for f in stale + live:
        f.write_text("partial")
    for f in stale[1:]:
        os.utime(f, (old, old))
    sio.atomic_write_jsonl(target, [{"a": 1}])
    assert sio.read_jsonl(target) == [{"a": 1}]
    assert [f.exists() for f in stale] == [False] * len(stale)
    assert all(f.exists() for f in live)


def test_stale_safetensors_and_dir_scratch_are_removed(tmp_path):
    host, dead = sio._host(), _dead_pid()
    target = tmp_path / "adapters.safetensors"
    scratch = [tmp_path / f".adapters.safetensors.{host}.{dead}.0123abcd.tmp.safetensors",
               tmp_path / f".adapters.{dead}.tmp.safetensors"]  # the former naming
    for f in scratch:
        f.write_bytes(b"partial")
    old = time.time() - 2 * sio.STALE_AFTER_S
    os.utime(scratch[1], (old, old))
    save_safetensors_atomic(target, {"a": mx.ones((3,))})
    assert not any(f.exists() for f in scratch) and mx.load(str(target))["a"].shape == (3,)

    out = tmp_path / "ckpt"  # a prepare-model / export build killed midway
    (left := tmp_path / f".ckpt.{host}.{dead}.0123abcd.tmp").mkdir()
    (left / "model.safetensors").write_bytes(b"partial")
    prep.prepare("random", "tiny-llama", out, tokenizer_gguf="none")
    assert not left.exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapters.safetensors", "ckpt"]


def _full(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("writer, value", [
    (sio.atomic_write_bytes, b"new"), (sio.atomic_write_text, "new"),
    (sio.atomic_write_json, {"new": 1}), (sio.atomic_write_jsonl, [{"new": 1}])])
def test_full_disk_names_the_path_and_keeps_the_previous_file(tmp_path, monkeypatch, writer,
                                                              value):
    target = tmp_path / "out.file"
    target.write_bytes(b"previous")
    monkeypatch.setattr(sio, "_write_all", _full)
    with pytest.raises(OSError) as e:
        writer(target, value)
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, sio.WriteError)
    assert f"cannot write {target}" in str(e.value) and "left unchanged" in str(e.value)
    assert target.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.file"]


def test_full_disk_safetensors(tmp_path, monkeypatch):
    target = tmp_path / "adapters.safetensors"
    save_safetensors_atomic(target, {"a": mx.ones((4,))})
    previous = target.read_bytes()
    monkeypatch.setattr(mx, "save_safetensors", _full)
    with pytest.raises(sio.WriteError, match=f"cannot write {target}"):
        save_safetensors_atomic(target, {"a": mx.zeros((4,))})
    assert target.read_bytes() == previous

    monkeypatch.undo()
    real = mx.save_safetensors

    def short(path, arrays, metadata=None):  # as mx does on a full disk: no error, short file
        real(path, arrays, metadata=metadata)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[:-8])

    monkeypatch.setattr(mx, "save_safetensors", short)
    with pytest.raises(sio.WriteError, match="bytes were written"):
        save_safetensors_atomic(target, {"a": mx.zeros((1000,))})
    assert target.read_bytes() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapters.safetensors"]


def test_prepare_full_disk_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(prep, "write_random", _full)
    p = argparse.ArgumentParser()
    prep.add_arguments(p)
    args = p.parse_args(["--source", "random", "--ref", "tiny-llama", "--tokenizer-gguf", "none",
                         "--out", str(tmp_path / "m")])
    assert prep.main(args) == 2
    err = capsys.readouterr().err
    assert f"cannot write {tmp_path / 'm'}" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# -- 4. the base model a PEFT export records -----------------------------------------------------

def _peft_base(out: Path) -> str:
    return json.loads((out / "peft/adapter_config.json").read_text())["base_model_name_or_path"]


def test_peft_records_given_hub_id(model_dir, good_adapter, tmp_path, capsys):
    assert export_cli(model_dir, good_adapter, tmp_path / "a", "--base-model-id", "org/base") == 0
    assert _peft_base(tmp_path / "a") == "org/base"
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("key", ["base_model", "_name_or_path"])
def test_peft_reads_hub_id_hint_from_config(model_dir, good_adapter, tmp_path, capsys, key):
    hinted = copy_adapter(model_dir, tmp_path / "model")
    cfg = json.loads((hinted / "config.json").read_text())
    (hinted / "config.json").write_text(json.dumps({**cfg, key: "google/gemma-3-270m"}))
    assert export_cli(hinted, good_adapter, tmp_path / "a") == 0
    assert _peft_base(tmp_path / "a") == "google/gemma-3-270m"
    assert "warning" not in capsys.readouterr().err


def test_peft_without_hub_id_records_absolute_path_and_warns(model_dir, good_adapter, tmp_path,
                                                             monkeypatch, capsys):
    local = copy_adapter(model_dir, tmp_path / "model")
    cfg = json.loads((local / "config.json").read_text())
    (local / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "/home/me/llama"}))
    monkeypatch.chdir(tmp_path)
    assert export_cli("model", good_adapter, "a") == 0  # a relative --model
    assert _peft_base(tmp_path / "a") == str(local.resolve())
    err = capsys.readouterr().err
    assert "warning" in err and "--base-model-id" in err


def test_prepare_hub_records_the_hub_id(model_dir, good_adapter, tmp_path, monkeypatch,
                                        capsys):
    import mlx_lm

    monkeypatch.setattr(prep, "hub_snapshot", lambda ref, timeout=None: model_dir)
    prep.prepare("hub", "org/tiny-llama", tmp_path / "m")
    assert json.loads((tmp_path / "m/config.json").read_text())["base_model"] == "org/tiny-llama"
    assert "base_model" not in json.loads((model_dir / "config.json").read_text())
    mlx_lm.load(str(tmp_path / "m"))  # mlx-lm ignores the key
    assert export_cli(tmp_path / "m", good_adapter, tmp_path / "a") == 0
    assert _peft_base(tmp_path / "a") == "org/tiny-llama"


def test_real_short_writes_under_a_file_size_limit(tmp_path):
    """A real failing disk write, no mocks: RLIMIT_FSIZE makes writes past 1 MB fail (EFBIG),
    which mx.save_safetensors ignores (as it ignores ENOSPC) and os.write reports."""
    code = f"""
import resource, signal, sys
from pathlib import Path
import mlx.core as mx
from segback.models.adapters import save_safetensors_atomic
from segback.io import WriteError, atomic_write_bytes
tmp = Path({str(tmp_path)!r})
save_safetensors_atomic(tmp / "a.safetensors", {{"w": mx.ones((4,))}})
atomic_write_bytes(tmp / "b.bin", b"previous")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
for name, write in [("a.safetensors", lambda: save_safetensors_atomic(
                        tmp / "a.safetensors", {{"w": mx.zeros((1 << 20,))}})),
                    ("b.bin", lambda: atomic_write_bytes(tmp / "b.bin", bytes(4 << 20)))]:
    try:
        write()
    except WriteError as e:
        assert f"cannot write {{tmp / name}}" in str(e), e
        print("refused", name)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:2] == ["refused a.safetensors", "refused b.bin"]
    assert mx.load(str(tmp_path / "a.safetensors"))["w"].tolist() == [1.0] * 4
    assert (tmp_path / "b.bin").read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.bin"]


def test_hub_id_loads_like_mlx_lm_and_fails_clearly_offline(monkeypatch):
    """`--model org/name` is read as mlx_lm.load reads it; offline and not cached, the answer
    says what to do instead of a traceback."""
    from segback.models.load import load

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="mlx-community/not-cached-anywhere"):
        load("mlx-community/not-cached-anywhere")


# -- issue 40: bad values, torn base weights, read-only disks, plans of other models ------------


def test_read_only_filesystem_names_the_file_not_the_cleanup(tmp_path, monkeypatch):
    """On a read-only filesystem the scratch file cannot be made and even unlinking it (never
    made) raises EROFS: that second error must not hide the first."""
    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(sio.os, "open", read_only)
    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(sio.WriteError, match=rf"cannot write {tmp_path / 'p.json'}: Read-only "
                                             "file system.*make it writable"):
        sio.atomic_write_json(tmp_path / "p.json", {"a": 1})


def test_plan_refuses_bad_targets_and_warns_on_absurd_peaks(tmp_path, capsys):
    from segback.cli import main

    for flag, value in (("--target-gb", "-1"), ("--target-gb", "nan"), ("--batch", "0"),
                        ("--time-budget", "inf")):
        rc = main(["plan", "--model", "tiny-llama", "--seq", "64", flag, value, "--out",
                   str(tmp_path / "p.json")])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith(f"segback plan: error: {flag}")
        assert not (tmp_path / "p.json").exists()
    assert main(["plan", "--model", "tiny-llama", "--seq", "1000000000", "--out",
                 str(tmp_path / "p.json")]) == 0
    assert "warning: the plan predicts a peak of" in capsys.readouterr().err


def test_plan_for_another_model_type_of_the_same_depth_is_refused(tmp_path):
    """tiny-qwen3 and tiny-llama both have 4 full-attention layers: only the model type tells
    the plans apart, and `train` must refuse one for the other, as the README says."""
    from test_train import small_cfg

    from segback.engine import PlanError
    from segback.planner import plan_segments
    from segback.trainer import cli

    plan = plan_segments("tiny-qwen3", 64, batch_size=2)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    model = build_model("tiny-llama")
    with pytest.raises(PlanError, match="made for a qwen3 model .* not llama"):
        cli.resolve_plan(small_cfg(tmp_path, plan=str(path)), model)
    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps(plan_segments("tiny-llama", 64, batch_size=2).to_dict()))
    cli.resolve_plan(small_cfg(tmp_path, plan=str(llama)), model)  # its own model's plan


def test_torn_base_weights_are_one_line(model_dir, tmp_path):
    import shutil

    torn = tmp_path / "model"
    shutil.copytree(model_dir, torn)
    weights = sorted(torn.glob("*.safetensors"))[0]
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=rf"{weights} cannot be read .*truncated or corrupt"):
        load(str(torn))


def test_adapter_path_naming_a_file_is_one_line(tmp_path, capsys):
    from segback.cli import main

    (tmp_path / "adapters").write_text("")
    rc = main(["train", "--model", "tiny-llama", "--data", str(tmp_path), "--adapter-path",
               str(tmp_path / "adapters"), "--iters", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"segback train: error: --adapter-path {tmp_path / 'adapters'} "
                               "is a file, not a directory: give a directory (the adapter's "
                               "files and checkpoints go inside it)"]
