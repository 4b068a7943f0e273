"""Pallas TPU KDA: interpret-mode parity with the float64 reference, errors, TPU AOT compile.

Interpret mode (interpret=True) runs the same kernels on CPU in true f32, so the parity cases
check the kernels' algebra and block plumbing; Mosaic's own lowering and compilation are checked
ahead of time for real TPU generations from this CPU host (libtpu + topology descriptions, in a
subprocess so the TPU compiler stays out of the test process). Numerics under Mosaic's matmul
precision need a TPU and are not covered here.
"""
import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import BF16_TOL, F32_TOL, assert_close, make_inputs, run, run_reference
from tpu_aot import run_aot_script

from k3jax.kernels.kda import KDA_IMPLS, get_kda_fn
from k3jax.kernels.kda.pallas_tpu import kda_pallas


PALLAS = functools.partial(kda_pallas, interpret=True)

# id, B, T, H, K, V, segments, initial state, gate, q/k/v dtype (chunk 64)
CASES = [
    ("t1", 1, 1, 2, 32, 16, "none", True, "k3", jnp.float32),
    ("t65_resets_f32", 1, 65, 2, 32, 16, "packed", True, "pinned", jnp.float32),
    ("t200_bf16", 2, 200, 1, 32, 32, "packed", True, "k3", jnp.bfloat16),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_pallas_interpret_matches_reference(case):
    cid, B, T, H, K, V, segs, use_h0, gate, dtype = case
    inputs, seg, cots = make_inputs("pallas_" + cid, B, T, H, K, V, segs=segs, gate=gate)
    got = run(PALLAS, inputs, seg, cots, dtype, use_h0)
    want = run_reference(inputs, seg, cots, dtype, use_h0)
    assert got[0].dtype == dtype and got[1].dtype == jnp.float32
    assert_close(got, want, F32_TOL if dtype == jnp.float32 else BF16_TOL)


def test_no_silent_fallback_off_tpu():
    assert set(KDA_IMPLS) == {"reference", "chunked", "pallas_tpu", "tokamax"}
    assert jax.default_backend() != "tpu"
    q = jnp.zeros((1, 8, 1, 16))
    with pytest.raises(RuntimeError, match="interpret=True"):
        kda_pallas(q, q, q, q, jnp.zeros((1, 8, 1)))
    with pytest.raises(RuntimeError, match="chunked"):
        get_kda_fn("pallas_tpu")
    with pytest.raises(ValueError, match="chunked.*pallas_tpu.*reference"):
        get_kda_fn("pallas")
    with pytest.raises(ValueError, match="batch_axes"):
        get_kda_fn("pallas_tpu", interpret=True)
    fn = get_kda_fn("pallas_tpu", interpret=True, batch_axes=("data",), head_axis=None)
    o, S = jax.jit(fn)(q, q, q, q, jnp.zeros((1, 8, 1)))
    assert o.shape == (1, 8, 1, 16) and S.shape == (1, 1, 16, 16)
    assert get_kda_fn("chunked", chunk_size=32).keywords == {"chunk_size": 32, "lower_bound": None}
    assert get_kda_fn("chunked", lower_bound=-5.0).keywords == {"chunk_size": 64, "lower_bound": -5.0}
    assert get_kda_fn("reference") is KDA_IMPLS["reference"]


_AOT_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    import jax, jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec as P
    from k3jax.kernels.kda import kda_pallas

    for topo, dtype in [("v5p:2x2x1", jnp.float32), ("v6e:2x2", jnp.bfloat16)]:
        devices = topologies.get_topology_desc(topology_name=topo, platform="tpu").devices
        mesh = jax.make_mesh((len(devices),), ("data",), devices=devices)
        B, T, H, D = len(devices), 128, 1, 128
        shapes = [((B, T, H, D), dtype)] * 3 + [((B, T, H, D), jnp.float32),
                  ((B, T, H), jnp.float32), ((B, H, D, D), jnp.float32), ((B, T), jnp.int32)]
        args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P("data")))
                for s, d in shapes]

        def local(q, k, v, g, beta, h0, seg):
            return kda_pallas(q, k, v, g, beta, initial_state=h0, segment_ids=seg)

        fwd = jax.shard_map(local, mesh=mesh, in_specs=(P("data"),) * 7,
                            out_specs=(P("data"), P("data")))

        def loss(*a):
            o, S = fwd(*a)
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(S ** 2)

        with jax.set_mesh(mesh):
            for name, f in [("fwd", fwd), ("bwd", jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))]:
                compiled = jax.jit(f).lower(*args).compile()
                text = compiled.as_text()
                print(json.dumps({"topo": topo, "kind": devices[0].device_kind, "pass": name,
                                  "mosaic_calls": text.count("tpu_custom_call")}), flush=True)
""")


def test_pallas_lowers_and_compiles_for_tpu():
    """Forward and backward kernels (interpret=False) compile for TPU v5p and v6e ahead of time."""
    proc, rows = run_aot_script(_AOT_SCRIPT)
    assert proc.returncode == 0 and len(rows) == 4, proc.stderr[-4000:]
    for row in rows:
        # forward: one walk kernel; backward: the replayed forward walk plus the reverse walk.
        assert row["mosaic_calls"] >= (1 if row["pass"] == "fwd" else 2), row
    assert {r["kind"] for r in rows} == {"TPU v5", "TPU v6 lite"}
    assert np.all([r["topo"] in ("v5p:2x2x1", "v6e:2x2") for r in rows])
