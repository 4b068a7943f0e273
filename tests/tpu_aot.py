"""Run an AOT-compile script for TPU topologies in a fresh interpreter and collect its JSON rows.

A subprocess because libtpu's compiler client and the 8 fake CPU devices of conftest do not mix in
one process; the script prints one JSON object per line for what it compiled."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_aot_script(script: str, timeout: int = 600):
    """-> (CompletedProcess, [rows]); skips the calling test when libtpu is not installed."""
    pytest.importorskip("libtpu")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.path.join(REPO, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=timeout)
    return proc, [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
