"""A ``shardtune`` command run in a fresh interpreter, and what it imported: counted, where a test would otherwise
time it (an import of torch is what makes a command slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_CODE = """\
import contextlib, io, json, sys
from shardtune.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main(json.loads(sys.argv[1]))
top = {name.split('.')[0] for name in sys.modules} - set(sys.stdlib_module_names)
print(json.dumps({"rc": rc, "packages": sorted(n for n in top if not n.startswith(('_', 'cython'))),
                  "modules": sorted(sys.modules), "stdout": out.getvalue()}))
"""


def run_fresh(argv: list[str], cache: Path) -> dict:
    """``shardtune ARGV`` in a new interpreter with an empty cache: its exit code, the third-party packages it
    imported (beside the standard library), every module it imported, and what it printed."""
    env = dict(os.environ, SHARDTUNE_CACHE=str(cache))
    proc = subprocess.run([sys.executable, "-c", _CODE, json.dumps(argv)], capture_output=True, text=True, env=env,
                          check=True)
    return json.loads(proc.stdout)
