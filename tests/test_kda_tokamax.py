"""kda_impl=tokamax: tokamax's KDA (gate fused in its kernel) against k3jax's float64 reference.

The reference side composes the layer's bounded gate, g = lb * sigmoid(exp(a_log) * (f + dt_bias)),
with the token-serial recurrence, so every gradient is checked: q, k, v, the pre-activation f,
beta, a_log, dt_bias and the initial state, plus the output and the final state (random
cotangents on both), by f32 relative RMS. On CPU the core runs tokamax's xla_chunked path; its
Mosaic TPU kernels are compiled ahead of time for v5p from this host (numerics on a TPU are not
covered here).
"""
import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import F32_TOL, make_inputs, rel
from tpu_aot import run_aot_script

from k3jax.kernels.kda import get_kda_fn
from k3jax.kernels.kda.reference import kda_reference
from k3jax.kernels.kda.tokamax import kda_tokamax
from k3jax.kernels.kda.tokamax import default_implementation
from k3jax.layers.kda import kda_cache_shapes

LB = -5.0
NAMES = ("o", "state", "dq", "dk", "dv", "df", "dbeta", "da_log", "ddt_bias", "dh0")


def _gate(f, a_log, dt_bias):
    return LB * jax.nn.sigmoid(jnp.exp(a_log)[:, None] * (f + dt_bias))


def _reference(q, k, v, f, beta, a_log, dt_bias, h0, *, seg, n):
    del n
    return kda_reference(q, k, v, _gate(f, a_log, dt_bias), beta, initial_state=h0, segment_ids=seg)


def _tokamax(q, k, v, f, beta, a_log, dt_bias, h0, *, seg, n):
    return kda_tokamax(q, k, v, f, beta, a_log=a_log, dt_bias=dt_bias, lower_bound=LB,
                       initial_state=h0, segment_ids=seg, max_num_segments=n)


@functools.partial(jax.jit, static_argnames=("fn", "n"))
def _out_and_grads(args, seg, cots, fn, n):
    out, vjp = jax.vjp(functools.partial(fn, seg=seg, n=n), *args)
    return out + vjp(cots)


def _case(cid, B, T, H, K, V, segs, pinned):
    """Inputs of kda.md §6 plus f, a_log, dt_bias; `pinned` drives half the heads' gates to the
    bound (sigmoid saturated: g = -5 to f32 rounding, for whole chunks)."""
    (q, k, v, _, beta, h0), seg, cots = make_inputs("tokamax_" + cid, B, T, H, K, V, segs=segs)
    rng = np.random.default_rng(len(cid))
    f = rng.standard_normal((B, T, H, K))
    if pinned:
        f[:, :, : H // 2 + 1] += 30.0
    a_log = np.log(rng.uniform(1.0, 16.0, (H,)))
    dt_bias = 0.3 * rng.standard_normal((H, K))
    return (q, k, v, f, beta, a_log, dt_bias, h0), (None if segs == "none" else seg), cots


# id, B, T, H, K, V, segments, gates at the bound
CASES = [
    ("t130_packed_resets", 2, 130, 2, 32, 16, "packed", True),   # varlen path, T % 64 != 0
    ("t128_fixed_length", 1, 128, 2, 32, 32, "none", True),       # fixed-length path (no ids)
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tokamax_matches_reference(case):
    cid, B, T, H, K, V, segs, pinned = case
    inputs, seg, cots = _case(cid, B, T, H, K, V, segs, pinned)
    n = 1 if seg is None else int(seg.max())                     # runs per row, at most
    got = _out_and_grads(tuple(jnp.asarray(x, jnp.float32) for x in inputs),
                         None if seg is None else jnp.asarray(seg),
                         tuple(jnp.asarray(c, jnp.float32) for c in cots), _tokamax, n)
    with jax.enable_x64(True):
        want = _out_and_grads(tuple(jnp.asarray(x, jnp.float64) for x in inputs),
                              None if seg is None else jnp.asarray(seg),
                              tuple(jnp.asarray(c, jnp.float64) for c in cots), _reference, n)
        want = [np.asarray(w) for w in want]
    assert got[0].dtype == jnp.float32 and got[1].shape == (B, H, K, V)
    errs = {name: rel(a, b) for name, a, b in zip(NAMES, got, want)}
    assert all(e <= F32_TOL for e in errs.values()), errs
    if pinned:                                                    # the bound is really reached
        g = np.asarray(_gate(*(jnp.asarray(inputs[i], jnp.float32) for i in (3, 5, 6))))
        assert (g[:, :, 0] <= LB + 1e-5).mean() > 0.99


def test_more_documents_than_slots_is_nan_not_silent():
    """tokamax would drop the runs past max_num_segments (zero output); here the call is NaN."""
    inputs, seg, _ = _case("overflow", 1, 64, 1, 16, 16, "packed", False)
    args = [jnp.asarray(x, jnp.float32) for x in inputs]
    # With n = seg.max() slots the same call is finite: test_tokamax_matches_reference.
    o, s = jax.jit(functools.partial(_tokamax, seg=jnp.asarray(seg), n=int(seg.max()) - 1))(*args)
    assert np.isnan(o).all() and np.isnan(s).all()


def test_platform_choice_and_errors():
    assert default_implementation("tpu") == "mosaic"
    assert default_implementation("cpu") == default_implementation("gpu") == "xla_chunked"
    axes = dict(batch_axes=("data",), head_axis=None)
    with pytest.raises(ValueError, match="lower_bound"):
        get_kda_fn("tokamax", **axes)
    with pytest.raises(ValueError, match="chunk_size=64"):
        get_kda_fn("tokamax", chunk_size=32, lower_bound=LB, **axes)
    q = jnp.zeros((1, 64, 1, 16))
    with pytest.raises(ValueError, match=r"\[-5, 0\)"):
        kda_tokamax(q, q, q, q, jnp.zeros((1, 64, 1)), a_log=jnp.zeros(1), dt_bias=jnp.zeros(16),
                    lower_bound=-6.0)


def _layers(impl):
    from flax import nnx

    from k3jax import config as C
    from k3jax.layers.kda import KDA
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["model_name=tiny", f"kda_impl={impl}"])
    return KDA(cfg.model, cfg.kernel, nnx.Rngs(0)), cfg


def test_layer_tokamax_equals_chunked():
    """The KDA layer with kda_impl=tokamax (pre-activation gate, A_log and dt_bias handed to the
    core) equals kda_impl=chunked (g computed by the layer) on packed rows with left padding, and
    on the serving path that continues a cache over a padded chunk (extend: padding must leave
    the state as it is). The gate's gradients are checked at kernel level above."""
    from flax import nnx

    from helpers import randomize
    tok, cfg = _layers("tokamax")
    ref, _ = _layers("chunked")
    randomize(tok, seed=3)
    nnx.update(ref, nnx.state(tok))
    x = jax.random.normal(jax.random.key(2), (2, 70, cfg.model.hidden_size))
    seg = jnp.asarray([[1] * 40 + [2] * 30, [0] * 6 + [1] * 64], jnp.int32)
    call = nnx.jit(lambda layer, x, seg: layer(x, seg)[0])
    out_t, out_r = call(tok, x, seg), call(ref, x, seg)
    # Two float32 paths, each within F32_TOL of float64 at kernel level: their difference is up
    # to about twice that, and the output norm and o_proj add their own rounding.
    tol = 5 * F32_TOL
    assert rel(out_t, out_r) <= tol and np.abs(out_r).max() > 0
    rng = np.random.default_rng(1)
    shapes = {k: s for k, (s, _, _) in kda_cache_shapes(cfg.model, 2).items()}
    cache = {k: jnp.asarray(0.5 * rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
    lengths = jnp.asarray([30, 17])
    ext = nnx.jit(lambda layer, x, c, n: layer.extend(x, c, n))
    (o_t, c_t), (o_r, c_r) = ext(tok, x[:, 40:], cache, lengths), ext(ref, x[:, 40:], cache, lengths)
    keep = np.arange(30)[None, :] < np.asarray(lengths)[:, None]
    assert rel(np.asarray(o_t)[keep], np.asarray(o_r)[keep]) <= tol
    assert rel(c_t["state"], c_r["state"]) <= tol


def test_config_errors():
    from k3jax import config as C
    base = C.REPO_CONFIGS / "base.yml"
    C.validate(C.load(base, ["kda_impl=tokamax"]))
    for bad, match in ((["kda_gate=softplus"], "kda_gate=bounded"), (["kda_chunk_size=32"], "kda_chunk_size=64"),
                       (["kda_gate_lower_bound=-8"], r"\[-5, 0\)"),
                       (["kda_tokamax_max_segments=0"], ">= 1"),
                       (["ici_context_parallelism=2"], "context parallelism")):
        with pytest.raises(C.ConfigError, match=match):
            C.validate(C.load(base, ["kda_impl=tokamax", *bad]))


_AOT_SCRIPT = textwrap.dedent("""
    import json, os
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    import jax, jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from k3jax.kernels.kda import get_kda_fn

    devices = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), devices=devices, axis_types=(AxisType.Auto,) * 2)
    B, T, H, D = 2, 256, 4, 128                   # rows over data, heads over tensor
    sds = lambda s, d, *spec: jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P(*spec)))
    row = ("data", None, "tensor", None)
    args = [sds((B, T, H, D), jnp.bfloat16, *row)] * 3 + [sds((B, T, H, D), jnp.float32, *row),
            sds((B, T, H), jnp.float32, "data", None, "tensor"), sds((B, T), jnp.int32, "data"),
            sds((H,), jnp.float32, "tensor"), sds((H, D), jnp.float32, "tensor")]
    axes = dict(batch_axes=("data",), head_axis="tensor")
    with jax.set_mesh(mesh):                      # the platform check reads the mesh's devices
        # pallas_tpu's own TPU compile is tests/test_kda_pallas.py's; benchmarks/kda_tpu_compare.py
        # compiles both at the K3 layer shape.
        cores = {"tokamax": get_kda_fn("tokamax", lower_bound=-5.0, max_num_segments=4, **axes)}
    for impl, core in cores.items():
        def fwd(q, k, v, f, beta, seg, a_log, dt_bias, core=core, impl=impl):
            if impl == "tokamax":
                return core(q, k, v, f, beta, a_log=a_log, dt_bias=dt_bias, segment_ids=seg)
            g = -5.0 * jax.nn.sigmoid(jnp.exp(a_log)[:, None] * (f + dt_bias))
            return core(q, k, v, g, beta, segment_ids=seg)

        def loss(*a, fwd=fwd):
            o, S = fwd(*a)
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(S ** 2)

        with jax.set_mesh(mesh):
            for name, f in [("fwd", fwd), ("bwd", jax.grad(loss, argnums=(0, 1, 2, 3, 4, 6, 7)))]:
                text = jax.jit(f).lower(*args).compile().as_text()
                print(json.dumps({"impl": impl, "kind": devices[0].device_kind, "pass": name,
                                  "mosaic_calls": text.count("tpu_custom_call")}), flush=True)
""")


def test_tokamax_tpu_kernels_compile_for_v5p():
    """tokamax's Mosaic kernels behind kda_impl=tokamax, forward and backward, compile for TPU v5p
    ahead of time at T=256, H=4, bf16 with packed segments, on 4 chips (rows over data=2, heads
    and tokamax's a_log / dt_bias over tensor=2)."""
    proc, rows = run_aot_script(_AOT_SCRIPT)
    assert proc.returncode == 0 and len(rows) == 2, proc.stderr[-4000:]
    for row in rows:
        assert row["kind"] == "TPU v5" and row["mosaic_calls"] >= (1 if row["pass"] == "fwd" else 2), row
