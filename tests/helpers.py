"""Helpers shared by test files: KDA inputs, output-and-gradient runs and tolerances; randomize.

test_kda_{chunked,pallas,sharded,decode}.py all compare a KDA path with the float64 token-serial
reference the same way: the output, the final state and the gradients of q, k, v, g, beta and
the initial state (random cotangents on both outputs), by relative RMS, rms(a - b) / rms(b).
make_inputs follows kda.md §6 (l2-normalised q, correlated keys, K3 / pinned / softplus / zero
gates, packed documents with resets inside sub-blocks, on consecutive tokens and exactly on chunk
boundaries) and seeds each case from its id. Pytest puts tests/ on sys.path (rootdir-relative
"prepend" import mode, no __init__.py here), so test files import this as `helpers`.
"""
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.kernels.kda.reference import kda_reference
from xla_flags import TEST_COMPILE_FLAGS

F32_TOL, BF16_TOL = 1e-5, 2e-2
NAMES = ("o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))


def make_inputs(case_id, B, T, H, K, V, *, segs="packed", gate="k3", chunk=64):
    """float64 numpy inputs (q, k, v, g, beta, h0), segment ids [B, T], cotangents."""
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    nrm = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    sig = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
    q = nrm(rng.standard_normal((B, T, H, K)))
    shared = rng.standard_normal((1, 1, H, K))                  # correlated keys
    k = nrm(rng.standard_normal((B, T, H, K)) + 1.5 * shared)
    v = rng.standard_normal((B, T, H, V))
    u = rng.standard_normal((B, T, H, K))
    g = {"k3": -5.0 * sig(2.0 * u),                              # K3 lower-bound gate
         "pinned": -5.0 + 0.01 * sig(u),                         # at the bound for whole chunks
         "softplus16": -16.0 * np.log1p(np.exp(u)),              # Kimi Linear gate, A = 16
         "zero": np.zeros_like(u)}[gate]
    beta = sig(rng.standard_normal((B, T, H)) + 2.0)
    h0 = 0.5 * rng.standard_normal((B, H, K, V))
    seg = np.ones((B, T), np.int32)                             # one document (same compile)
    if segs == "packed":
        # Resets in every 16-row sub-block of the first chunk, on consecutive tokens, exactly
        # on chunk boundaries, plus random ones; the last token alone is a document.
        fixed = {5, 20, 30, 31, 37, 50, chunk, 2 * chunk, 2 * chunk + 1, T - 1}
        starts = np.zeros((B, T), bool)
        for b in range(B):
            starts[b] = rng.random(T) < 0.02
            starts[b, [t for t in fixed if 0 < t + b < T]] = True
        starts[:, 0] = False
        seg = np.cumsum(starts, axis=1).astype(np.int32) + 1
    cots = (rng.standard_normal((B, T, H, V)), rng.standard_normal((B, H, K, V)))
    return (q, k, v, g, beta, h0), seg, cots


@functools.partial(jax.jit, static_argnames=("fn", "use_h0"))
def _out_and_grads(args, seg, cots, fn, use_h0=True):
    def f(q, k, v, g, beta, h0):
        return fn(q, k, v, g, beta, initial_state=h0 if use_h0 else None, segment_ids=seg)
    out, vjp = jax.vjp(f, *args)
    return out + vjp(tuple(c.astype(x.dtype) for c, x in zip(cots, out)))


def run(fn, inputs, seg, cots, dtype=jnp.float32, use_h0=True):
    """(o, state, dq, dk, dv, dg, dbeta, dh0) of fn; q, k, v in `dtype`, the rest f32 (f64 if
    dtype is f64)."""
    rest = jnp.float64 if dtype == jnp.float64 else jnp.float32
    args = tuple(jnp.asarray(x, dtype if i < 3 else rest) for i, x in enumerate(inputs))
    cots = (jnp.asarray(cots[0], dtype), jnp.asarray(cots[1], rest))
    return _out_and_grads(args, seg, cots, fn, use_h0)


def run_reference(inputs, seg, cots, dtype=jnp.float32, use_h0=True):
    """The reference in float64 on the same (dtype-rounded) inputs."""
    with jax.enable_x64(True):
        rest = jnp.float64 if dtype == jnp.float64 else jnp.float32
        inputs = tuple(np.asarray(jnp.asarray(x, dtype if i < 3 else rest), np.float64)
                       for i, x in enumerate(inputs))
        cots = (np.asarray(jnp.asarray(cots[0], dtype), np.float64), cots[1])
        out = run(kda_reference, inputs, seg, cots, jnp.float64, use_h0)
        return [np.asarray(x) for x in out]


def assert_close(got, want, tol, skip=()):
    errs = {n: rel(a, b) for n, a, b in zip(NAMES, got, want) if n not in skip}
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"relative RMS errors above {tol}: {bad} (all: {errs})"


def randomize(model, seed=0, scale=0.3):
    """Make every weight of a model (AttnRes queries, router biases included) random and
    O(1)-sensitive (numpy draws: hundreds of eager jax.random calls would each compile)."""
    rng = np.random.default_rng(seed)
    leaves, tdef = jax.tree.flatten(nnx.state(model))
    new = [(np.asarray(x, np.float32) + scale * rng.standard_normal(x.shape) if x.ndim < 2
            else scale * rng.standard_normal(x.shape)).astype(x.dtype) for x in leaves]
    nnx.update(model, jax.tree.unflatten(tdef, [jnp.asarray(x) for x in new]))
    return model


# -- the tiny trained checkpoint shared by the decode and serving tests ------------------------------
# peak_tflops: a stated MFU denominator, so each training subprocess skips the ~5 s CPU matmul-peak
# measurement (no test reads the MFU's value).
TINY_TRAIN = ["model_name=tiny", "vocab_size=512", "per_device_batch_size=2", "max_target_length=32",
              "log_period=1", "enable_tensorboard=false", "async_checkpointing=false", "peak_tflops=0.1"]
REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def tool_env():
    """Environment of a tool subprocess: one CPU device, the same in every process of a test, and
    single-threaded Eigen so a matmul's reduction order cannot depend on thread scheduling."""
    import os
    e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    e["XLA_FLAGS"] = f"--xla_cpu_multi_thread_eigen=false {TEST_COMPILE_FLAGS}"
    return e


def run_tool(tool, *args, check=True, timeout=600):
    """``python -m k3jax.<tool> configs/base.yml *args`` -> CompletedProcess (AssertionError on failure)."""
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", f"k3jax.{tool}", "configs/base.yml", *args], env=tool_env(),
                       capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if check and p.returncode != 0:
        raise AssertionError(f"{tool} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def check_greedy(label, got, got_lp, want, ref_logprobs) -> bool:
    """got == want token for token; at the first difference the reference's top-2 log-probability
    gap must be below 1e-4 (a near tie that float rounding may break either way) and the chosen
    token's log-probability must match the reference's to 1e-5; the sequences may part there.
    -> whether they parted at a near tie."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            ref = ref_logprobs(i)
            top2 = np.sort(ref)[-2:]
            assert top2[1] - top2[0] < 1e-4, f"{label}: token {i} is {a}, want {b} (top-2 gap {top2[1] - top2[0]:.2e})"
            assert abs(got_lp[i] - ref[a]) <= 1e-5, f"{label}: token {i}: logprob {got_lp[i]} vs {ref[a]}"
            return True
    assert len(got) == len(want), f"{label}: {len(got)} tokens, want {len(want)}"
    return False

