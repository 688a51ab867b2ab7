"""The Hugging Face Hub, reached so that it never hangs: offline settings read when asked, a TCP
probe before any request, and timeouts on every request huggingface_hub sends without one.
`segback prepare-model --source hub`, `segback.models.load` (a Hub id as the model) and
`segback.data.sources` (a Hub dataset) go through here.
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import huggingface_hub.constants as hc
from huggingface_hub import snapshot_download
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

try:
    from huggingface_hub.utils import get_session
except ImportError:  # another huggingface_hub: its own timeouts apply
    get_session = None


def offline() -> bool:
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return hc.HF_HUB_OFFLINE or (env or "").strip().lower() in {"1", "true", "yes", "on"}


def hub_timeout() -> float:
    """Seconds to wait for the Hub to answer: HF_HUB_ETAG_TIMEOUT (read now, not at import
    like huggingface_hub's constants), default 10."""
    try:
        return max(float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or 10), 0.1)
    except ValueError:
        return 10.0


def hub_snapshot(repo: str, timeout: float | None = None) -> Path:
    """A local snapshot of a Hub repo: the HF cache first, then a download; never hangs offline,
    nor on an endpoint that accepts connections but does not answer (`_request_timeouts`)."""
    timeout = hub_timeout() if timeout is None else timeout
    kwargs = dict(allow_patterns=DEFAULT_ALLOW_PATTERNS)
    try:
        return Path(snapshot_download(repo, local_files_only=True, **kwargs))
    except Exception as cached_error:  # not in the local HF cache
        if offline():
            raise RuntimeError(_hub_help(repo, "HF_HUB_OFFLINE is set and it is not in the "
                                               "local Hugging Face cache")) from cached_error
    reason = unreachable(timeout)
    if reason:
        raise RuntimeError(_hub_help(repo, reason))
    try:
        with _request_timeouts(timeout):
            return Path(snapshot_download(repo, etag_timeout=timeout, **kwargs))
    except Exception as e:
        raise RuntimeError(_hub_help(repo, _short_reason(e, timeout))) from e


def _short_reason(e: BaseException, timeout: float) -> str:
    """One line on why a download failed (huggingface_hub's messages span several lines)."""
    chain, seen = [], e
    while seen is not None and len(chain) < 5:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if any("Timeout" in type(x).__name__ for x in chain):
        return f"{hc.ENDPOINT} accepted the connection but did not answer within {timeout:g}s"
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0] if first else ''}".strip()


@contextmanager
def _request_timeouts(timeout: float):
    """Give every request of huggingface_hub's shared HTTP client a timeout where it has none.

    huggingface_hub (2.x) sends the repo_info and tree-listing requests of `snapshot_download`
    with `timeout=None`, which no setting (HF_HUB_ETAG_TIMEOUT / HF_HUB_DOWNLOAD_TIMEOUT) reaches:
    an endpoint that accepts the connection and never answers hangs it forever. A request hook
    fills the unset connect/read/write/pool timeouts (read: between two received bytes, so
    large downloads are not cut short).
    """
    try:
        session = get_session()
        hooks = session.event_hooks
    except (TypeError, AttributeError):  # another huggingface_hub: its own timeouts apply
        yield
        return

    def hook(request) -> None:
        current = request.extensions.get("timeout") or {}
        filled = {k: timeout if current.get(k) is None else current[k]
                  for k in ("connect", "read", "write", "pool")}
        request.extensions = {**request.extensions, "timeout": filled}

    session.event_hooks = {**hooks, "request": [*hooks.get("request", []), hook]}
    try:
        yield
    finally:
        now = session.event_hooks
        session.event_hooks = {**now, "request": [h for h in now.get("request", [])
                                                  if h is not hook]}


def unreachable(timeout: float) -> str | None:
    """Why the Hub cannot be reached, or None: a TCP probe, which fails fast where packets are
    dropped (skipped when a proxy is configured, as the probe would bypass it)."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(hc.ENDPOINT)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"cannot connect to {host}:{port} within {timeout:g}s: {e}"
    return None


def _hub_help(repo: str, reason: str) -> str:
    return (
        f"cannot get {repo!r} from the Hugging Face Hub ({reason}). Download it on a machine with "
        f"network access (`hf download {repo} --local-dir DIR`), copy DIR here, then set the "
        f"model's `path: DIR` in the workflow config (or run `segback prepare-model --source "
        f"local --ref DIR --out ...`)."
    )
