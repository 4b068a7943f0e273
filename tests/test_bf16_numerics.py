"""bf16 numerics of the tiny K3, part by part (issue 53, item 00; docs/architecture.md "bf16 numerics").

The shared trained checkpoint (``tiny_run``: 4 f32 steps) runs as a float32 and a bfloat16 network of
the same (bf16-rounded) weights, layer by layer in lockstep (benchmarks/bf16_parts.py ``measure``):
``acc`` is the bf16 network on its own residual state (error accumulated through the depth), ``local``
the bf16 layer on the f32 run's residual state rounded to bf16 (the layer's own error). Each bound is
the measured worst layer (XLA:CPU, 2026-12-07, batch 2 x 32 tokens of seed 1) times about 3, so a
different backend's bf16 accumulation order passes while a part that leaves f32 (bf16 scores, gates,
state or softmax: errors of 1e-2 and more locally) fails.

part              acc       bound     local     bound
router scores     1.64e-03  0.005     2.94e-04  0.001     (relative RMS; so are the rows not marked |dp|)
router weights    2.00e-03  0.006     5.98e-04  0.002
top-k flips       4.69e-02  0.15      3.12e-02  0.1       (fraction of tokens whose expert set differs)
AttnRes |dp|      1.96e-03  0.006     6.43e-04  0.002     (max abs difference of the depth-softmax weights)
AttnRes out       2.73e-02  0.08      4.59e-03  0.015
KDA g             9.06e-04  0.003     1.92e-04  0.0006
KDA beta          1.16e-03  0.004     2.32e-04  0.0007
KDA state         4.41e-02  0.13      6.51e-03  0.02      (final recurrent state)
KDA out           4.38e-02  0.13      7.94e-03  0.025     (core output)
MLA |dp|          1.95e-04  0.0006    4.20e-05  0.00015   (softmax probabilities)
MLA max logit     1.70e-02  0.05      3.47e-03  0.01      (QK-clip's input)
MLA out           1.73e-02  0.05      6.09e-03  0.02
logits            2.77e-02  0.08      3.05e-03  0.01
|d loss|          2.84e-04  0.001     4.43e-05  0.0002    (mean cross-entropy, absolute)
"""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import config as C
from k3jax import sharding as S
from k3jax.state import restore_model

_BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
sys.path.insert(0, _BENCHMARKS)     # the measurement is the benchmark's (one place), not a copy
try:
    import bf16_parts  # noqa: E402
finally:
    sys.path.remove(_BENCHMARKS)

# Worst-layer bounds (measurement x ~3, see the module docstring). Top-k flips are discrete: a token
# near a tie between two experts flips with any rounding, so their bound is looser.
BOUNDS = {
    "acc": {"router_scores": 5e-3, "router_w": 6e-3, "router_flip": 0.15, "attn_res_p": 6e-3,
            "attn_res_out": 8e-2, "kda_g": 3e-3, "kda_beta": 4e-3, "kda_state": 0.13, "kda_o": 0.13,
            "mla_p": 6e-4, "mla_max_logit": 5e-2, "mla_o": 5e-2, "logits": 8e-2, "loss_abs": 1e-3},
    "local": {"router_scores": 1e-3, "router_w": 2e-3, "router_flip": 0.1, "attn_res_p": 2e-3,
              "attn_res_out": 1.5e-2, "kda_g": 6e-4, "kda_beta": 7e-4, "kda_state": 2e-2, "kda_o": 2.5e-2,
              "mla_p": 1.5e-4, "mla_max_logit": 1e-2, "mla_o": 2e-2, "logits": 1e-2, "loss_abs": 2e-4},
}
# Parts the bf16 network must compute in float32, as the references do: the router (transformers
# DeepseekV3TopkRouter and NeMo's KimiK3Gate: f32 logits of f32 inputs), the AttnRes depth softmax
# (NeMo _apply_attn_res), the KDA gate, write strength and state (fla: f32 gate and state; k3jax also
# keeps beta and q/k/v in f32), QK-clip's max logit and the logits.
F32_PARTS = ("router_scores", "router_w", "attn_res_pre_p", "attn_res_ffn_p", "kda_g", "kda_beta", "kda_state",
             "mla_max_logit", "logits")


@pytest.fixture(scope="module")
def measured(tiny_run):
    cfg = C.load(C.REPO_CONFIGS / "base.yml", tiny_run.args + [f"load_parameters_path={tiny_run.checkpoint}",
                                                             "dtype=float32", "weight_dtype=float32"])
    model = restore_model(cfg, S.make_mesh(cfg, jax.devices()[:1]))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.model.vocab_size, (2, 32)))
    return bf16_parts.measure(cfg, nnx.state(model), tokens)


def test_bf16_parts_within_bounds(measured):
    """Every part's worst-layer bf16 error (accumulated and local) is within its bound, the bf16 run
    did run in bf16 (logits differ), and its top-1 tokens mostly agree with f32's."""
    print({t: {k: f"{v:.2e}" for k, v in measured[t].items()} for t in ("acc", "local")})
    bad = {(t, k): (measured[t][k], b) for t in BOUNDS for k, b in BOUNDS[t].items() if not measured[t][k] <= b}
    assert not bad, f"bf16 parts above their bounds (measured, bound): {bad}"
    assert measured["acc"]["logits"] > 1e-4
    assert measured["acc"]["top1_agree"] >= 0.9


def test_bf16_keeps_the_reference_f32_parts(measured):
    """The bf16 network computes the router, the AttnRes depth softmax, the KDA gate, beta and state,
    the MLA max logit and the logits in float32."""
    dt = measured["bf16_run_dtypes"]
    assert dt["kda_o"] == "float32" and dt["attn_res_pre_out"] == "bfloat16", dt   # it ran in bf16 around them
    assert {k: dt[k] for k in F32_PARTS} == dict.fromkeys(F32_PARTS, "float32"), dt


def _rel64(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want ** 2)))


def test_router_is_float32_on_bf16_activations():
    """The router of a bf16 MoE layer gives the float64 scores of its bf16 input to f32 precision
    (measured 5e-8); logits computed in bf16, as vLLM's Kimi Linear does, miss them by ~1e-3, which
    the bounds above cannot tell from the rounding of the router's input."""
    from k3jax.layers.moe import MoE
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["model_name=tiny"])
    moe = MoE(cfg.model, cfg.kernel, nnx.Rngs(0), (), jnp.bfloat16)
    rng = np.random.default_rng(0)
    moe.router[...] = jnp.asarray(0.3 * rng.standard_normal(moe.router[...].shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal((64, cfg.model.hidden_size)), jnp.bfloat16)
    w, idx, scores = moe.route(x)
    want = 1 / (1 + np.exp(-np.asarray(x, np.float64) @ np.asarray(moe.router[...], np.float64)))
    assert scores.dtype == w.dtype == jnp.float32
    assert _rel64(scores, want) <= 1e-6, _rel64(scores, want)


def test_attn_res_mix_is_float32_inside():
    """AttnRes mixes bf16 sources in f32 and rounds once: its bf16 output is the float64 mix rounded
    to bf16 (relative RMS 0 measured); the same mix computed in bf16 is 4e-3 away."""
    from k3jax.layers.attn_res import attn_res_mix
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    blocks = jnp.asarray(3 * rng.standard_normal((3, 2, 16, 32)), bf)
    partial = jnp.asarray(rng.standard_normal((2, 16, 32)), bf)
    w, gamma = jnp.asarray(0.3 * rng.standard_normal(32), bf), jnp.asarray(1 + 0.1 * rng.standard_normal(32), bf)
    src = np.concatenate([np.asarray(blocks, np.float64)[:2], np.asarray(partial, np.float64)[None]], 0)
    s = np.einsum("sbtd,d->sbt", src, np.asarray(gamma, np.float64) * np.asarray(w, np.float64))
    s /= np.sqrt(np.mean(src ** 2, -1) + 1e-5)
    a = np.exp(s - s.max(0))
    want = np.einsum("sbt,sbtd->btd", a / a.sum(0), src)
    got = attn_res_mix(blocks, 2, partial, w, gamma, 1e-5)
    assert got.dtype == bf and _rel64(got, jnp.asarray(want, bf)) <= 3e-4, _rel64(got, jnp.asarray(want, bf))
