"""The test suite's XLA:CPU compile flags against XLA's defaults: compile seconds, run seconds, and
whether every output is bit for bit the same.

tests/conftest.py adds ``TEST_COMPILE_FLAGS`` (``--xla_llvm_disable_expensive_passes=true``: XLA's
HLO passes run as always, LLVM skips its expensive optimisation passes on the emitted code) to
the suite's XLA_FLAGS, because compiling is most of the suite's time. A test must still check the
numbers users' programs compute, so this script runs the programs the tests compile most (the tiny
K3 and the Kimi-Linear-shaped tiny of tests/test_model.py: forward, every gradient,
``generate()``, and a forward over 8 devices split over data x fsdp x expert) in two child
processes, one per flag set, on the suite's 8 host devices, and compares every output array bit
for bit. Run it again after a jax upgrade:

    .venv/bin/python benchmarks/compile_flags.py
Results: stdout table and benchmarks/results/compile_flags.json (--out to change).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from common import ROOT, cpu_only, machine, print_table, result_path, write_json

CHILD = "--child" in sys.argv     # one flag set's run, with the suite's 8 host devices (set by the parent)
if not CHILD:
    cpu_only()
sys.path.insert(0, os.path.join(ROOT, "tests"))
from xla_flags import TEST_COMPILE_FLAGS  # noqa: E402


def run_programs(path: str) -> None:
    """Compile and run each program once with this process's XLA_FLAGS -> path.npz (every output
    array) and path.json (compile and run seconds per program)."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from helpers import randomize
    from k3jax import config as C
    from k3jax import model as M
    from k3jax import sharding as S
    from k3jax.inference.generate import generate
    from k3jax.state import init_state
    from test_model import KIMI_LINEAR_TINY
    jax.config.update("jax_default_matmul_precision", "highest")      # as tests/conftest.py
    out, rows = {}, []

    def timed(name, fn, *args):
        t0 = time.perf_counter()
        compiled = fn.lower(*args).compile()
        seconds = time.perf_counter() - t0
        res = jax.block_until_ready(compiled(*args))
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            runs.append(time.perf_counter() - t0)
        rows.append({"program": name, "compile_s": seconds, "run_s": float(np.median(runs))})
        out.update({f"{name}/{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(res))})

    for name, args in (("tiny K3", ["model_name=tiny"]), ("Kimi-Linear tiny", KIMI_LINEAR_TINY)):
        cfg = C.load(C.REPO_CONFIGS / "base.yml", args)
        gdef, state = nnx.split(randomize(M.build(cfg, 0)))
        tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.model.vocab_size, (2, 200)))

        def forward(state, t, gdef=gdef):
            return nnx.merge(gdef, state)(t)[0]

        def loss(state, t):
            logits = forward(state, t)
            return jnp.mean(jax.nn.log_softmax(logits) * jnp.cos(jnp.arange(logits.shape[-1])))

        timed(f"{name} forward, [2, 200] tokens", jax.jit(forward), state, tokens)
        timed(f"{name} loss and every gradient", jax.jit(jax.value_and_grad(loss)), state, tokens)
        t0 = time.perf_counter()
        toks, timing = generate(nnx.merge(gdef, state), [list(range(5, 40)), list(range(7, 20))], max_new_tokens=16)
        rows.append({"program": f"{name} generate()", "compile_s": timing["compile_s"],
                     "run_s": time.perf_counter() - t0 - timing["compile_s"]})
        out[f"{name} generate()/0"] = np.asarray(toks)

    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["model_name=tiny", "ici_fsdp_parallelism=2",
                                               "ici_expert_parallelism=2", "ici_data_parallelism=2"])
    mesh = S.make_mesh(cfg)
    gdef, st, _ = init_state(cfg, mesh, seed=0)
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, cfg.model.vocab_size, (8, 64)))
    with jax.set_mesh(mesh):
        timed("tiny K3 forward over data 2 x fsdp 2 x expert 2", jax.jit(lambda s, t: nnx.merge(gdef, *s)(t)[0]),
              (st["params"], st["rest"]), tokens)
    np.savez(path + ".npz", **out)
    with open(path + ".json", "w") as f:
        json.dump(rows, f)


def child(flags: str, path: str) -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {flags}".strip())
    subprocess.run([sys.executable, os.path.abspath(__file__), "--child", path], cwd=ROOT, env=env, check=True)
    with open(path + ".json") as f:
        return json.load(f)


def main(argv=None):
    import numpy as np
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=result_path("compile_flags"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return run_programs(a.child)
    with tempfile.TemporaryDirectory() as work:
        base = child("", os.path.join(work, "default"))
        test = child(TEST_COMPILE_FLAGS, os.path.join(work, "tests"))
        x, y = np.load(os.path.join(work, "default.npz")), np.load(os.path.join(work, "tests.npz"))
        differ = sorted(k for k in x.files if not np.array_equal(x[k], y[k]))
        arrays = len(x.files)
    rows = []
    for b, t in zip(base, test):
        mine = [k for k in x.files if k.startswith(b["program"] + "/")]
        rows.append({"program": b["program"], "arrays": len(mine), "same": sum(k not in differ for k in mine),
                     "compile_default": b["compile_s"], "compile_tests": t["compile_s"],
                     "compile_ratio": t["compile_s"] / b["compile_s"],
                     "run_ms_default": 1e3 * b["run_s"], "run_ms_tests": 1e3 * t["run_s"]})
    print(f"XLA:CPU, 8 host devices; the tests' flags: {TEST_COMPILE_FLAGS}")
    print_table(rows, [("program", "program", "s"), ("arrays", "arrays", "d"), ("bit-identical", "same", "d"),
                       ("compile s default", "compile_default", ".2f"), ("compile s tests", "compile_tests", ".2f"),
                       ("ratio", "compile_ratio", ".2f"), ("run ms default", "run_ms_default", ".1f"),
                       ("run ms tests", "run_ms_tests", ".1f")])
    total = [sum(r[k] for r in rows) for k in ("compile_default", "compile_tests")]
    print(f"compile total {total[0]:.1f} s default, {total[1]:.1f} s with the tests' flags "
          f"({total[1] / total[0]:.2f}x); {arrays - len(differ)} of {arrays} output arrays bit-identical")
    write_json(a.out, {"flags": TEST_COMPILE_FLAGS, "rows": rows, "arrays": arrays, "differ": differ,
                       "machine": machine()})
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
