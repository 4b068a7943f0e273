"""scripts/gpu_check.sh: its CPU dry run (every JAX part at tiny sizes, and the wheel list against the
GPU path's imports), and the bf16 model numerics test its one-device list runs on the card."""
import json
import os
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from helpers import randomize
from k3jax import config as C
from k3jax import model as M
from xla_flags import TEST_COMPILE_FLAGS

ROOT = Path(__file__).resolve().parents[1]
# Relative RMS error of the tiny K3's bf16 logits against float32 with the same (bf16-rounded)
# weights: 1.05e-1 measured on XLA:CPU (2026-12-06, randomize()'s weights). Without AttnRes and MoE
# (dense FFNs) the same check gives 2.1e-2 at 1 layer and 4.7e-2 at 5; a broken bf16 path gives
# errors of order 1. The bound is fixed from that CPU run, with 2.4x room for another backend's bf16
# accumulation order, before any GPU run.
BF16_LOGITS_BOUND = 0.25


def test_bf16_forward_matches_float32():
    """The whole tiny K3 (KDA, MLA, latent MoE, AttnRes) in bf16 activations and weights follows the
    float32 forward of the same weights within BF16_LOGITS_BOUND (and above 1e-3: it did run in bf16)."""
    cfgs = {dt: C.load(C.REPO_CONFIGS / "base.yml", ["model_name=tiny", f"dtype={dt}", f"weight_dtype={dt}"])
            for dt in ("float32", "bfloat16")}
    m32 = randomize(M.build(cfgs["float32"], 0))
    m16 = M.build(cfgs["bfloat16"], 0)
    src = jax.tree.leaves(nnx.state(m32))
    dst, tdef = jax.tree.flatten(nnx.state(m16))
    w16 = [a.astype(b.dtype) for a, b in zip(src, dst)]
    nnx.update(m16, jax.tree.unflatten(tdef, w16))
    nnx.update(m32, jax.tree.unflatten(jax.tree.structure(nnx.state(m32)), [w.astype(a.dtype) for w, a in zip(w16, src)]))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfgs["float32"].model.vocab_size, (2, 24)))
    forward = nnx.jit(lambda m, t: m(t)[0])
    with jax.default_matmul_precision("highest"):
        want = np.asarray(forward(m32, tokens), np.float64)
    got = forward(m16, tokens)                  # float32 logits of a bf16 network
    err = float(np.sqrt(np.mean((np.asarray(got, np.float64) - want) ** 2)) / np.sqrt(np.mean(want ** 2)))
    print(f"bf16 logits relative RMS error {err:.2e} (bound {BF16_LOGITS_BOUND})")
    assert 1e-3 < err <= BF16_LOGITS_BOUND, err


def test_gpu_check_dry_run(tmp_path):
    """`scripts/gpu_check.sh --dry-run`: every JAX part of the GPU check on CPU at tiny sizes writes its
    JSON, the one-device test list still collects, k3-slice is 4.88B parameters, and the wheel list
    covers the GPU path's imports (scripts/gpu_imports.py). The compile cache of this session
    (JAX_COMPILATION_CACHE_DIR, set by conftest) is inherited, so a warm run mostly skips compiling."""
    env = dict(os.environ, XLA_FLAGS=TEST_COMPILE_FLAGS)   # one real CPU device, not 8
    t0 = time.perf_counter()
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(tmp_path)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    log = (tmp_path / "gpu_check.log").read_text() if (tmp_path / "gpu_check.log").exists() else ""
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:] + log[-4000:]
    status = json.loads((tmp_path / "gpu_check.json").read_text())
    assert status["dry_run"] and status["ok"]
    assert {p["part"] for p in status["parts"]} >= {"train_step", "kda", "decode", "tests", "imports",
                                                    "ragged_dot_lowering"}
    lowering = json.loads((tmp_path / "ragged_dot_lowering.json").read_text())
    assert lowering["verdict"] == "every group on every row", lowering   # XLA:CPU's known lowering: the check sees it
    train = json.loads((tmp_path / "train_step.json").read_text())
    assert train["mode"] == "gpu" and train["rows"][0]["settings"]["dtype"] == "bfloat16"
    assert train["rows"][0]["mu_dtype" if "mu_dtype" in train["rows"][0] else "settings"]
    kda = json.loads((tmp_path / "kda.json").read_text())
    assert kda["dtype"] == "bfloat16" and kda["rows"][0]["chunked"]["fwd_bwd_s"] > 0
    decode = json.loads((tmp_path / "decode_vs_hf.json").read_text())
    assert decode["dry_run"] and decode["rows"][0]["k3jax_new_tokens_per_s"] > 0
    assert "parameters: total 4.88B" in log
    print(f"gpu_check.sh --dry-run: {wall:.1f} s\n{r.stdout}")


def test_gpu_imports_names_a_module_the_wheels_miss(monkeypatch, capsys):
    """The import check fails, naming the module, when a needed package is neither on the GPU image
    nor in the wheel list (grain, which k3jax's data pipeline imports); the dry run shows it passing."""
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_imports
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    entry = [str(ROOT / "benchmarks" / "train_step.py")]       # passing with the list: the dry run
    wheels = gpu_imports.wheel_list()
    monkeypatch.setattr(gpu_imports, "wheel_list", lambda: {k: v for k, v in wheels.items() if k != "grain"})
    assert gpu_imports.main(entry) == 1
    assert "error: module 'grain'" in capsys.readouterr().out
