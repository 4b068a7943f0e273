"""Seeded mutants: bugs the suite must catch, before and after any change that makes it faster.

Each mutant replaces one exact line of the source (a KDA gate's sign flipped, an off-by-one in the
decode step's visible window, the AttnRes block sum dropped, a K3 tool call's argument key and value
swapped, a resumed run starting one step late) in a copy of the tree, then runs the tests that
should catch it there (the copy's ``src`` first on PYTHONPATH, so its k3jax is the one imported).
A mutant is killed when those tests fail (pytest exit 1); one that passes, or whose line is no
longer found, is reported. Shrinking a test (fewer steps, smaller shapes, a merged fixture) must
leave every mutant killed.

    .venv/bin/python scripts/mutants.py [--only NAME ...] [--out PATH]

Prints a table (mutant, what it breaks, tests, outcome, seconds) and writes JSON (default
benchmarks/results/mutants.json); exits 1 if any mutant survives.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    breaks: str
    path: str             # relative to the repo root
    old: str              # one exact, unique line (stripped of its indentation when matched)
    new: str
    tests: tuple[str, ...]


MUTANTS = (
    Mutant("kda_gate_sign", "the tiny K3's bounded KDA gate flips sign (decay becomes growth)",
           "src/k3jax/layers/kda.py",
           "return c.kda_gate_lower_bound * jax.nn.sigmoid(a * u)    # in (lb, 0)",
           "return -c.kda_gate_lower_bound * jax.nn.sigmoid(a * u)",
           ("tests/test_model.py::test_matches_float64_reference",)),
    Mutant("decode_off_by_one", "an MLA decode step no longer sees the token it writes",
           "src/k3jax/layers/mla.py",
           "valid = (s[None, :] >= start[:, None]) & (s[None, :] <= pos[:, None])",
           "valid = (s[None, :] >= start[:, None]) & (s[None, :] < pos[:, None])",
           ("tests/test_model.py::test_prefill_then_decode_equals_full_forward",)),
    Mutant("attn_res_block_dropped", "a finished AttnRes block is stored as zeros instead of its sum",
           "src/k3jax/model.py",
           'blocks = jnp.where(flag, jax.lax.dynamic_update_index_in_dim(res["blocks"], res["partial"], res["n"], 0),',
           'blocks = jnp.where(flag, jax.lax.dynamic_update_index_in_dim(res["blocks"], 0 * res["partial"], res["n"], 0),',
           ("tests/test_model.py::test_matches_float64_reference",)),
    Mutant("tool_call_args_swapped", "a K3 tool call's argument key and value change places",
           "src/k3jax/data/k3_toolcalls.py",
           "call.args[call.key] = _typed(text, call.type)",
           "call.args[text] = call.key",
           ("tests/test_k3_toolcalls.py",)),
    Mutant("resume_step_off_by_one", "a resumed run starts one step after its checkpoint",
           "src/k3jax/train.py",
           "start = last or 0",
           "start = last + 1 if last is not None else 0",
           ("tests/test_train.py::test_killed_run_resumes_with_identical_losses",)),
)


def apply(tree: Path, m: Mutant) -> bool:
    """Replace m.old (one line, matched without its indentation) in the copy; False if not found once."""
    f = tree / m.path
    lines = f.read_text().splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.strip() == m.old.strip()]
    if len(hits) != 1:
        return False
    i = hits[0]
    indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = indent + m.new.strip() + "\n"
    f.write_text("".join(lines))
    return True


def run(m: Mutant, timeout: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".venv", ".git", ".pytest_cache", "runs",
                                                                  "__pycache__", "*.egg-info", ".whl"))
        if not apply(tree, m):
            return {"mutant": m.name, "outcome": "line not found", "seconds": 0.0}
        env = dict(os.environ, PYTHONPATH=f"{tree / 'src'}{os.pathsep}{tree}"
                   + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""),
                   # compiled programs the mutant does not change are read from the main tree's cache
                   JAX_COMPILATION_CACHE_DIR=os.environ.get(
                       "JAX_COMPILATION_CACHE_DIR", str(ROOT / ".pytest_cache" / "jax-compilation-cache")))
        t0 = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, "-m", "pytest", *m.tests, "-x", "-q", "-p", "no:cacheprovider"],
                               cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
            rc, tail = r.returncode, (r.stdout + r.stderr).strip().splitlines()[-1:]
        except subprocess.TimeoutExpired:
            rc, tail = -1, ["timed out"]
        outcome = {1: "killed", 0: "SURVIVED"}.get(rc, f"error (pytest exit {rc})")
        return {"mutant": m.name, "outcome": outcome, "seconds": time.perf_counter() - t0,
                "last_line": tail[0] if tail else ""}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help="mutant names (default: all)")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per mutant")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mutants.json"))
    a = ap.parse_args()
    chosen = [m for m in MUTANTS if not a.only or m.name in a.only]
    unknown = set(a.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        print(f"error: unknown mutants {sorted(unknown)}; choose from {[m.name for m in MUTANTS]}", file=sys.stderr)
        return 2
    rows = []
    for m in chosen:
        row = run(m, a.timeout)
        row.update(breaks=m.breaks, tests=list(m.tests))
        rows.append(row)
        print(f"{m.name:24s} {row['outcome']:10s} {row['seconds']:7.1f} s  {' '.join(m.tests)}  ({row.get('last_line', '')})",
              flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"rows": rows}, f, indent=2)
    print(f"wrote {a.out}")
    return 0 if all(r["outcome"] == "killed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
