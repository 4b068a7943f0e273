"""Expert parallelism on the 8 fake CPU devices: equals the single-device kernels.

XLA:CPU cannot run `ragged_all_to_all`, so the dropless runs here use transport="padded" (the
same offsets and sizes through an exact emulation, itself checked against the documented
ragged_all_to_all semantics below); the ragged transport is compiled for a TPU topology.
"""
import functools
import importlib.util
import math
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from k3jax.kernels.moe.dispatch import moe_capacity, moe_dropless
from k3jax.kernels.moe.expert_parallel import dispatch_bytes_per_token, moe_expert_parallel
from k3jax.kernels.moe.routing import route
from k3jax.kernels.moe.expert_parallel import padded_ragged_all_to_all

N, D, F, E, K = 64, 16, 24, 8, 2
NAMES = ("data", "fsdp", "expert")
AXES = dict(expert_axis="expert", token_axes=("data", "fsdp"))   # the test meshes' names


def swiglu(g, u):
    return jax.nn.silu(g) * u


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b ** 2), 1e-30)))


@functools.lru_cache(maxsize=None)
def _mesh(shape, axis_type=AxisType.Explicit):
    return jax.make_mesh(shape, NAMES, axis_types=(axis_type,) * 3)


def _problem(routing):
    ks = jax.random.split(jax.random.key(5), 6)
    x = jax.random.normal(ks[0], (N, D))
    wg = jax.random.normal(ks[1], (E, D, F)) / math.sqrt(D)
    wu = jax.random.normal(ks[2], (E, D, F)) / math.sqrt(D)
    wd = jax.random.normal(ks[3], (E, F, D)) / math.sqrt(F)
    ct = jax.random.normal(ks[4], (N, D))
    weights, idx = route(jax.random.normal(ks[5], (N, E)), None, top_k=K)
    if routing == "hot":
        # Three quarters of the tokens pick experts 2 and 3 (both on expert-device 1): one
        # device receives far more than its share, the others nearly nothing.
        hot = jnp.arange(N) % 4 != 0
        idx = jnp.where(hot[:, None], jnp.array([[3, 2]], jnp.int32), idx)
    return x, weights, idx, wg, wu, wd, ct


def _shard_weights(mesh, wg, wu, wd, fsdp_weights):
    """Expert weights as the layer stores them: experts over `expert`, D optionally FSDP."""
    d = "fsdp" if fsdp_weights else None
    put = lambda w, spec: jax.device_put(w, NamedSharding(mesh, spec))
    return (put(wg, P("expert", d, None)), put(wu, P("expert", d, None)),
            put(wd, P("expert", None, d)))


def _loss_and_grads(fn):
    def loss(x, w, wg, wu, wd, idx, ct):
        out = fn(x, w, idx, wg, wu, wd)
        out, aux = out if isinstance(out, tuple) else (out, 0.0)
        return jnp.sum(out * ct), (out, aux)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
    return jax.jit(lambda *a: (lambda r: (r[0][1], r[1]))(grad(*a)))


_single_dropless = _loss_and_grads(lambda *a: moe_dropless(*a, swiglu))


def _assert_same(got, want, tol=2e-6):
    (out, aux), grads = got
    (want_out, want_aux), want_grads = want
    assert rel_rms(out, want_out) < tol
    assert float(aux) == pytest.approx(float(want_aux), abs=1e-7)
    for name, g, w in zip(["x", "weights", "w_gate", "w_up", "w_down"], grads, want_grads):
        assert g.shape == w.shape
        assert rel_rms(g, w) < tol, name


EP_CASES = {
    # (mesh shape, axis type, grouped-matmul impl, FSDP on the experts' D dim)
    "fsdp2-ragged_dot": ((1, 2, 4), AxisType.Explicit, "ragged_dot", True),
    "data2-megablox": ((2, 1, 4), AxisType.Explicit, "megablox", False),
    # the blocked scan (the CPU grouped matmul, custom VJP) inside the map
    "fsdp2-blocked": ((1, 2, 4), AxisType.Explicit, "blocked", True),
    # Auto meshes carry no layout in the type: the FSDP axis is passed as weight_d_axes.
    "auto-fsdp2": ((1, 2, 4), AxisType.Auto, "ragged_dot", True),
}


@functools.lru_cache(maxsize=None)
def _ep_dropless(case):
    shape, axis_type, impl, fsdp_weights = EP_CASES[case]
    mesh = _mesh(shape, axis_type)
    d_axes = ("fsdp",) if fsdp_weights and axis_type == AxisType.Auto else None
    return _loss_and_grads(lambda *a: moe_expert_parallel(
        *a, swiglu, mesh=mesh, **AXES, impl=impl, interpret=True, transport="padded",
        weight_d_axes=d_axes))


@pytest.mark.parametrize("case, routing", [
    ("fsdp2-ragged_dot", "random"), ("fsdp2-ragged_dot", "hot"), ("data2-megablox", "hot"),
    ("auto-fsdp2", "hot"), ("fsdp2-blocked", "hot")])
def test_ep_dropless_matches_single_device(case, routing):
    shape, axis_type, _, fsdp_weights = EP_CASES[case]
    x, w, idx, wg, wu, wd, ct = _problem(routing)
    wg_s, wu_s, wd_s = _shard_weights(_mesh(shape, axis_type), wg, wu, wd, fsdp_weights)
    got = _ep_dropless(case)(x, w, wg_s, wu_s, wd_s, idx, ct)
    _assert_same(got, _single_dropless(x, w, wg, wu, wd, idx, ct))
    if axis_type == AxisType.Explicit:
        (out, _), grads = got
        assert out.sharding.spec == P(NAMES, None)
        assert grads[2].sharding.spec == wg_s.sharding.spec      # FSDP-sharded weight grads


def test_ep_capacity_matches_single_device():
    mesh = _mesh((1, 2, 4))
    x, w, idx, wg, wu, wd, ct = _problem("hot")
    wg_s, wu_s, wd_s = _shard_weights(mesh, wg, wu, wd, True)
    ep = lambda cf: _loss_and_grads(lambda *a: moe_expert_parallel(
        *a, swiglu, mesh=mesh, **AXES, mode="capacity", capacity_factor=cf))
    # Huge capacity: nothing dropped, equals dropless.
    got = ep(E / K)(x, w, wg_s, wu_s, wd_s, idx, ct)
    _assert_same(got, _single_dropless(x, w, wg, wu, wd, idx, ct))
    # Tight capacity: GShard groups = token shards, so it equals the single-device capacity
    # kernel applied to each of the 8 shards (shard s = rows [s*n, (s+1)*n)).
    shards = 8

    def per_shard(x, w, idx, wg, wu, wd):
        outs, drops = jax.vmap(lambda a, b, c: moe_capacity(a, b, c, wg, wu, wd, swiglu,
                                                            capacity_factor=1.0))(
            *(t.reshape(shards, N // shards, *t.shape[1:]) for t in (x, w, idx)))
        return outs.reshape(N, D), drops.mean()

    got = ep(1.0)(x, w, wg_s, wu_s, wd_s, idx, ct)
    want = _loss_and_grads(per_shard)(x, w, wg, wu, wd, idx, ct)
    assert 0.2 < float(want[0][1]) < 0.8                     # the hot experts overflow
    _assert_same(got, want)


def test_padded_transport_follows_ragged_all_to_all_semantics():
    """Random ragged exchange on a 4-way axis vs a numpy model of the documented semantics."""
    ep, rows, cap = 4, 6, 12
    rng = np.random.default_rng(0)
    send = rng.integers(0, 3, size=(ep, ep)).astype(np.int32)           # send[src, dst]
    operand = rng.normal(size=(ep, rows, 3)).astype(np.float32)
    in_off = np.cumsum(send, 1) - send                                   # packed per source
    recv = send.T.copy()                                                 # recv[dst, src]
    recv_off = np.cumsum(recv, 1) - recv + 1                             # leave row 0 alone
    out_off = recv_off.T.copy()                                          # out_off[src, dst]
    want = np.full((ep, cap, 3), -1.0, np.float32)
    for s in range(ep):
        for d in range(ep):
            want[d, recv_off[d, s]:recv_off[d, s] + send[s, d]] = \
                operand[s, in_off[s, d]:in_off[s, d] + send[s, d]]
    mesh = jax.make_mesh((ep,), ("expert",), axis_types=(AxisType.Explicit,))
    body = lambda o, out, a, b, c, d: padded_ragged_all_to_all(
        o[0], out[0], a[0], b[0], c[0], d[0], axis_name="expert", chunk_rows=rows)[None]
    spec = P("expert")
    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))(
        *(jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec)) for a in (
            operand, np.full((ep, cap, 3), -1.0, np.float32), in_off, send, out_off, recv)))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_ep_rejects_bad_layouts():
    mesh = _mesh((1, 2, 4))
    x, w, idx, wg, wu, wd, _ = _problem("random")
    with pytest.raises(ValueError, match="lacks axes"):
        moe_expert_parallel(x, w, idx, wg, wu, wd, swiglu, mesh=mesh, expert_axis="expert", token_axes=("pod",))
    bad = jax.device_put(wg, NamedSharding(mesh, P("expert", None, "fsdp")))
    with pytest.raises(ValueError, match="ffn dim"):
        moe_expert_parallel(x, w, idx, bad, wu, wd, swiglu, mesh=mesh, **AXES)
    with pytest.raises(ValueError, match="capacity_factor"):
        moe_expert_parallel(x, w, idx, wg, wu, wd, swiglu, mesh=mesh, **AXES, mode="capacity")
    with pytest.raises(ValueError, match="row_axes"):
        moe_expert_parallel(x, w, idx, wg, wu, wd, swiglu, mesh=mesh, **AXES, row_axes=("expert", "fsdp"))


def test_dispatch_bytes_per_token_k3():
    v = dispatch_bytes_per_token(d_model=3584, top_k=16, ep=32)
    one_way = 16 * 3584 * 2 * 31 / 32                     # k rows of D bf16, 31/32 off-device
    assert v["forward"] == pytest.approx(2 * one_way)     # dispatch + combine
    assert v["backward"] == pytest.approx(2 * one_way)
    cap = dispatch_bytes_per_token(d_model=3584, top_k=16, ep=32, mode="capacity",
                                   capacity_factor=1.25)
    assert cap["forward"] == pytest.approx(1.25 * v["forward"])


_AOT_SCRIPT = textwrap.dedent("""
    import os
    os.environ["JAX_PLATFORMS"] = "cpu"
    import numpy as np
    import jax, jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
    from k3jax.kernels.moe import moe_expert_parallel
    topo = topologies.get_topology_desc(topology_name="v5p:2x2x2", platform="tpu")
    mesh = Mesh(np.array(topo.devices).reshape(1, 2, 4), ("data", "fsdp", "expert"),
                axis_types=(AxisType.Explicit,) * 3)
    n, d, f, e, k = 1024, 256, 512, 16, 4
    S = lambda shape, dt, spec: jax.ShapeDtypeStruct(shape, dt,
                                                     sharding=NamedSharding(mesh, spec))
    tok = P(("data", "fsdp", "expert"), None)
    w_in, w_out = P("expert", "fsdp", None), P("expert", None, "fsdp")
    bf = jnp.bfloat16
    args = (S((n, d), bf, tok), S((n, k), jnp.float32, tok), S((n, k), jnp.int32, tok),
            S((e, d, f), bf, w_in), S((e, d, f), bf, w_in), S((e, f, d), bf, w_out))
    act = lambda g, u: jax.nn.silu(g) * u
    for kw in (dict(impl="megablox", transport="ragged"),
               dict(impl="ragged_dot", transport="ragged"),
               dict(mode="capacity", capacity_factor=1.25)):
        def loss(x, w, idx, wg, wu, wd):
            out = moe_expert_parallel(x, w, idx, wg, wu, wd, act, mesh=mesh, expert_axis="expert",
                                      token_axes=("data", "fsdp"), **kw)
            return jnp.sum(out[0] if isinstance(out, tuple) else out)
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 3, 4, 5)))
        hlo = step.trace(*args).lower().compile().as_text()
        want = "ragged-all-to-all" if kw.get("transport") == "ragged" else "all-to-all"
        assert want in hlo, kw
        print("AOT-OK", kw)
""")


def test_ep_ragged_compiles_for_tpu_topology():
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu not importable")
    proc = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert proc.stdout.count("AOT-OK") == 3, proc.stderr[-3000:]
