"""Pretrained weights without a network: is the weights file cached, can its host be reached, and the one
line that says what to do when neither holds.

torchvision downloads ``:<weights>`` through ``torch.hub`` into ``$TORCH_HOME/hub/checkpoints`` and
timm ``:pretrained`` through the Hugging Face hub into ``$HF_HOME/hub``; offline, the first fails with
a bare ``<urlopen error ...>`` and the second retries for about a minute.  Before either loads, the
model source asks :func:`reachable` once (one TCP connection to the host, at most
:data:`CONNECT_TIMEOUT` seconds, DNS included), unless the weights are cached: then an unreachable
hub is put in offline mode (:func:`hub_offline`) so that the cached file loads at once.
``REPSIM_OFFLINE=1`` (or ``HF_HUB_OFFLINE=1``) declares the machine offline without asking.
"""
from __future__ import annotations

import os
import socket
import threading
from contextlib import contextmanager
from typing import Iterator
from urllib.parse import urlparse

CONNECT_TIMEOUT = 3.0  # seconds for the DNS lookup and the TCP connection together
OFFLINE_ENV = ("REPSIM_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_SEEN: dict[tuple[str, int], bool] = {}  # (host, port) -> reachable, asked once per process


def declared_offline() -> bool:
    """Whether an environment variable of :data:`OFFLINE_ENV` says there is no network."""
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on") for k in OFFLINE_ENV)


def reachable(url: str, timeout: float = CONNECT_TIMEOUT) -> bool:
    """Whether ``url``'s host accepts a TCP connection within ``timeout`` seconds (asked once per host and
    process; False at once when :func:`declared_offline`).  The lookup runs on a daemon thread, since a
    resolver without network may ignore socket timeouts."""
    if declared_offline():
        return False
    parsed = urlparse(url)
    host = parsed.hostname or url
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
    key = (host, port)
    if key not in _SEEN:
        result: list[bool] = []

        def connect() -> None:
            try:
                socket.create_connection(key, timeout=timeout).close()
                result.append(True)
            except OSError:
                result.append(False)

        thread = threading.Thread(target=connect, name="repsim-reachable", daemon=True)
        thread.start()
        thread.join(timeout + 0.5)
        _SEEN[key] = bool(result and result[0])
    return _SEEN[key]


def host_of(url: str) -> str:
    return urlparse(url).hostname or url


def unavailable(spec: str, filename: str, cache_dir: str, host: str, cache_env: str, local: str,
                reason: str = "cannot be reached (no network?)") -> ValueError:
    """The one-line error: which file, where it was looked for, and how to pass a local one."""
    return ValueError(f"extract: {spec!r}: the weights file {filename} is not in {cache_dir} and {host} {reason}; "
                      f"copy the file there ({cache_env} moves that cache) or pass a local file: {local}")


@contextmanager
def hub_offline() -> Iterator[None]:
    """The Hugging Face hub in offline mode (cached files only, no request, no retry) for the block."""
    import huggingface_hub.constants as constants

    before, env = constants.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE")
    constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before
        if env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = env
