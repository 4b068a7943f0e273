"""Golden parity with Hugging Face transformers ``kimi_linear`` (tests/assets/kimi_linear_tiny,
made by scripts/make_goldens.py): weights loaded through the converter's name map, logits and
per-layer hidden states over 72-token sequences, and cached decode."""
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from conversion.hf_to_k3jax import load_into_model, model_overrides_from_hf
from conversion.safetensors_io import CheckpointReader, read_config
from k3jax import config as C
from k3jax import model as M

ASSETS = Path(__file__).parent / "assets"
ASSET = ASSETS / "kimi_linear_tiny"


forward = nnx.jit(lambda m, t: m(t)[0])
step = nnx.jit(lambda m, tok, cache, pos, start: m.decode_step(tok, cache, pos, start))
def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def cached_decode(model, g):
    """Prefill the golden's first decode_prompt_len tokens, then feed the rest one at a time:
    the step logits [B, steps, V], as transformers' cached decode produced them."""
    from k3jax.inference.batch_prefill import left_pad, prefill
    ids = np.asarray(g["input_ids"], np.int32)
    n, steps = int(g["decode_prompt_len"]), g["decode_logits"].shape[1]
    toks, seg, start = left_pad([list(r[:n]) for r in ids])
    logits, cache = nnx.jit(prefill, static_argnums=4)(model, jnp.asarray(toks), jnp.asarray(seg),
                                                       jnp.asarray(start), n + steps)
    got = []
    for i in range(steps):
        logits, cache = step(model, jnp.asarray(ids[:, n + i]), cache, n + i, jnp.asarray(start))
        got.append(logits)
    return jnp.stack(got, 1)


def load_asset(asset: Path, tmp, *extra):
    (tmp / "model.yml").write_text(yaml.safe_dump(model_overrides_from_hf(read_config(str(asset)))))
    cfg = C.load(C.REPO_CONFIGS / "base.yml", [f"model_name={tmp / 'model.yml'}", *extra])
    reader = CheckpointReader(str(asset))
    model = load_into_model(M.build(cfg, 0), cfg.model, reader.get_dequantized, reader.keys())
    return cfg, model, np.load(asset / "golden.npz")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_asset(ASSET, tmp_path_factory.mktemp("kl"), "scan_layers=false")


def test_deepseek_v3_yarn_logits_and_decode(tmp_path):
    """Kimi K2 / DeepSeek-V3 switches: all-MLA with YaRN RoPE, grouped top-k, q LoRA; positions
    run past the YaRN original length (32) up to 72."""
    cfg, model, g = load_asset(ASSETS / "deepseek_v3_tiny", tmp_path)
    m = cfg.model
    assert m.mla_use_rope and m.rope_scaling_factor == 4 and (m.n_group, m.topk_group) == (4, 2)
    assert model.layout.num_periods == 3
    ids = np.asarray(g["input_ids"], np.int32)
    logits = forward(model, jnp.asarray(ids))
    assert rel_rms(logits, g["logits"]) <= 1e-4
    assert rel_rms(cached_decode(model, g), g["decode_logits"]) <= 1e-4


def test_derived_config_matches_asset(loaded):
    cfg, _, _ = loaded
    m = cfg.model
    assert sorted(m.mla_layer_set) == [3, 5] and m.first_k_dense == 1
    assert (m.kda_gate, m.kda_output_gate, m.ffn_activation, m.attn_res) == ("softplus", "low_rank", "swiglu", False)
    assert m.q_lora_rank is None and not m.mla_use_output_gate and m.moe_latent_size is None


def test_logits_match_transformers(loaded):
    _, model, g = loaded
    logits = forward(model, jnp.asarray(g["input_ids"], jnp.int32))
    assert rel_rms(logits, g["logits"]) <= 1e-4


def test_hidden_states_per_layer(loaded):
    cfg, model, g = loaded
    tokens = jnp.asarray(g["input_ids"], jnp.int32)
    seg = jnp.ones(tokens.shape, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    res = model._initial_residual(model.embed(tokens))
    np.testing.assert_allclose(res["h"], g["hidden_states"][0], rtol=0, atol=1e-6)
    for l, layer in enumerate(model.prefix):
        res, _, _ = layer(res, seg, pos, first=l == 0)
        want = g["hidden_states"][l + 1] if l + 1 < cfg.model.num_layers else g["last_layer_output"]
        assert rel_rms(res["h"], want) <= 1e-4, f"layer {l}"


def test_cached_decode_matches_transformers(loaded):
    _, model, g = loaded
    assert rel_rms(cached_decode(model, g), g["decode_logits"]) <= 1e-4
