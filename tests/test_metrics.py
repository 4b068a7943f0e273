"""The CPU matmul 'peak' behind MFU: best of several timed runs, with their spread."""
from k3jax.metrics import measure_cpu_matmul_peak, measure_cpu_matmul_tflops


def test_cpu_peak_is_the_best_of_its_runs_with_the_spread():
    p = measure_cpu_matmul_peak(n=128, runs=3, seconds=0.05)
    assert len(p["runs_tflops"]) == 3 and all(r > 0 for r in p["runs_tflops"])
    assert p["tflops"] == max(p["runs_tflops"])
    assert p["spread"] == (max(p["runs_tflops"]) - min(p["runs_tflops"])) / max(p["runs_tflops"])
    assert 0 <= p["spread"] < 1 and (p["n"], p["seconds"]) == (128, 0.05)
    assert measure_cpu_matmul_tflops(n=128, runs=1, seconds=0.02) > 0


def test_profile_groups_leaf_ops_by_named_scope(tmp_path):
    """benchmarks/common.profile_top_ops with the compiled HLO text: a jitted loss with two named
    scopes inside a scan, differentiated, comes back as fwd/bwd groups of those scopes, the scan's
    while op left out of the sum (its body's ops are in the trace on their own)."""
    import pathlib
    import sys

    import jax
    import jax.numpy as jnp
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import common

    assert common.scope_of("jit(step)/transpose(jvp(jit(f)))/while/body/mixer/dot_general") == "bwd mixer"
    assert common.scope_of("jit(step)/jvp(ffn)/ffn/dispatch/dot_general") == "fwd dispatch"
    assert common.scope_of("jit(step)/optimizer/newton_schulz/dot_general") == "newton_schulz"
    assert common.scope_of("jit(step)/add") == "other" and common.scope_of(None) == "(no op_name)"

    def f(w, x):
        def body(h, _):
            with jax.named_scope("mixer"):
                h = jnp.tanh(h @ w)
            with jax.named_scope("loss"):
                return h, jnp.sum(h * h)
        return jnp.sum(jax.lax.scan(body, x, None, length=3)[1])

    step = jax.jit(jax.grad(f))
    w, x = jnp.ones((64, 64)) / 64, jnp.ones((32, 64))
    compiled = step.lower(w, x).compile()
    names = common.hlo_op_names(compiled.as_text())
    assert any("mixer" in n for n in names.values())
    out = common.profile_top_ops(lambda: jax.block_until_ready(compiled(w, x)), str(tmp_path), top=5,
                                 hlo_text=compiled.as_text())
    scopes = {r["scope"] for r in out["scopes"]}
    assert {"fwd mixer", "bwd mixer"} <= scopes, scopes
    assert all(not r["top_op"].startswith("while") for r in out["scopes"])
    assert abs(sum(r["share_pct"] for r in out["scopes"]) - 100) < 1e-6 and len(out["ops"]) <= 5
