"""The Hugging Face hub, asked once whether it can be reached before anything is loaded from it.

Without a network, huggingface_hub retries every request with back-off (about 50 s and 20 lines of retry
warnings per name) before it falls back to its local cache. One short request decides instead: when the hub
cannot be reached, this process (and the ranks a launcher starts, which inherit its environment) read the local
cache only (``HF_HUB_OFFLINE=1``), so a cached model loads at once and a missing one fails at once.

Also which names are hub names at all: a local path is never looked up there. A leaf module: the config checks,
the data readers and the commands ask it, and it asks none of them.
"""

from __future__ import annotations

import logging
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

log = logging.getLogger("shardtune")

PROBE_TIMEOUT_S = 3.0
# Data files by suffix: a name ending like one is a local path, never a hub data set.
EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv",
              ".tsv": "tsv"}


def looks_like_local_path(name: str) -> bool:
    """A name read as a local path, never a hub name: ./x, /x, ~/x, a/b/c, or one ending like a data file."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).suffix.lower() in EXTENSIONS


def offline_already() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")


def hub_names(*names: str | None) -> list[str]:
    """The names that would be read from the hub: neither local paths nor existing folders."""
    return [n for n in names if n and not looks_like_local_path(n) and not Path(n).expanduser().exists()]


def reachable(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``endpoint`` answers at all (any HTTP status counts), through the environment's proxies."""
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return True  # it answered
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return True


def offline_unless_reachable(*names: str | None) -> None:
    """Switch to the local cache (``HF_HUB_OFFLINE=1``) when ``names`` include hub names and the hub cannot be
    reached; nothing when every name is local, or the environment already decided."""
    wanted = hub_names(*names)
    if not wanted or offline_already():
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if reachable(endpoint):
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    # huggingface_hub and datasets read the variable when imported; either may already be
    for module, attribute in (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE")):
        if module in sys.modules:
            setattr(sys.modules[module], attribute, True)
    log.warning("cannot reach %s: %s will be read from the local Hugging Face cache only (HF_HUB_OFFLINE=1)",
                endpoint, ", ".join(wanted))
