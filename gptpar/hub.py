"""A quick, bounded probe of the Hugging Face hub, so an offline machine never stalls a run."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import socket
import sys
from urllib.parse import urlparse

OFFLINE_VALUES = ("1", "true", "yes", "on")


def hub_offline_requested() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in OFFLINE_VALUES


def _connect(host: str, port: int, timeout: float) -> None:
    with socket.create_connection((host, port), timeout=timeout):
        pass


def force_offline() -> None:
    """Offline mode for this process, including libraries that read HF_HUB_OFFLINE at import time."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    for module in ("huggingface_hub.constants", "datasets.config"):
        if module in sys.modules:
            sys.modules[module].HF_HUB_OFFLINE = True


@functools.cache
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """True when a TCP connection to the hub endpoint opens within `timeout_s` (DNS included).

    When it does not, offline mode is forced for this process so that transformers and datasets
    use their local caches instead of retrying the network themselves.
    """
    if hub_offline_requested():
        force_offline()
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        pool.submit(_connect, url.hostname or "", port, timeout_s).result(timeout=timeout_s)
        return True
    except Exception:
        force_offline()
        return False
    finally:
        pool.shutdown(wait=False)
