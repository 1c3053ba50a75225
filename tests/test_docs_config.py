"""docs/config.md lists every config key with its real default, and is exactly what its generator writes."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from pathlib import Path

from shardtune.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_doc_is_up_to_date():
    text = (ROOT / "docs" / "config.md").read_text()
    assert text == _generator().render(), ("docs/config.md is out of date: run "
                                           ".venv/bin/python scripts/gen_config_docs.py")


def test_every_key_has_its_default_in_the_doc(monkeypatch):
    rows = dict(re.findall(r"^\| `(\w+)` \| [^|]+ \| `([^`]*)` \|", (ROOT / "docs" / "config.md").read_text(), re.M))
    for name in [k for k in os.environ if k.startswith("SHARDTUNE_")]:  # the doc shows the defaults users get
        monkeypatch.delenv(name)
    cfg = TrainConfig()
    expected = {}
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            expected[f.name] = ("unset" if value is None else str(value).lower() if isinstance(value, bool)
                                else str(value))
    assert rows == expected


def test_every_key_says_what_it_does():
    """Each key's declaration carries its help, which the doc (checked above to be the generator's), --help-keys and
    the JSON Schema show; a key declared without one leaves its cell empty or holding only its bounds or choices."""
    from shardtune.config.schema import all_keys

    undocumented = [d.name for d in all_keys() if not d.meta.help.strip()]
    assert not undocumented, f"give these keys a description in shardtune/config/schema.py: {undocumented}"
