"""Each platform's paths by default: what the ``auto`` kernel keys pick on CPU, GPU and TPU
(k3jax.kernels.platform.AUTO), the cuDNN attention path (run through XLA here), explicit settings a
platform cannot run as one-line ConfigErrors, the expert-parallel training case that needs no extra
keys on CPU, and the quiet CPU start of a host with libtpu and no TPU."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import REPO
from k3jax import config as C
from k3jax import jax_platforms as runtime
from k3jax.kernels.attention import auto_attention, get_attention_fn, resolve_attention
from k3jax.kernels.attention.cudnn import cudnn_attention
from k3jax.kernels.attention.prefill import QUERY_BLOCK
from k3jax.kernels.attention.reference import causal_attention
from k3jax.kernels.kda import get_kda_fn
from k3jax.kernels.moe.gmm import resolve_impl
from k3jax.kernels.platform import AUTO, resolve
from k3jax.loss import resolve_loss_impl
from k3jax.schema import ConfigError


def test_auto_resolves_per_platform_and_explicit_values_stay():
    want = {"cpu": ("padded", "chunked", "jnp", "blocked", "chunked_fused"),
            "tpu": ("ragged", "chunked", "blocked", "ragged_dot", "chunked"),
            "gpu": ("ragged", "chunked", "cudnn", "ragged_dot", "chunked"),
            "cuda": ("ragged", "chunked", "cudnn", "ragged_dot", "chunked")}
    for platform, (transport, kda, attn, moe, loss) in want.items():
        assert resolve("moe_ep_transport", "auto", platform) == transport
        assert resolve("kda_impl", "auto", platform) == kda
        assert resolve("attention_impl", "auto", platform) == attn
        assert resolve_impl("auto", platform) == moe            # moe_impl and loss_impl resolve
        assert resolve_loss_impl("auto", platform) == loss     # through the same table
    for key, picks in AUTO.items():
        for value in set(picks.values()):
            assert resolve(key, value, "tpu") == value
    assert resolve("kda_impl", "auto") == "chunked"             # the default backend here: CPU
    with pytest.raises(ValueError, match="kda_impl=auto has no choice for platform 'metal'"):
        resolve("kda_impl", "auto", "metal")
    cfg = C.load(C.REPO_CONFIGS / "base.yml", [])
    assert (cfg.kernel.moe_ep_transport, cfg.kernel.kda_impl, cfg.kernel.attention_impl) == ("auto",) * 3


def _qkv(dtype, t=16, dqk=24, dv=16, h=2, seed=0):
    r = np.random.default_rng(seed)
    q, k = (jnp.asarray(r.normal(size=(2, t, h, dqk)), dtype) for _ in range(2))
    v = jnp.asarray(r.normal(size=(2, t, h, dv)), dtype)
    seg = jnp.asarray(np.array([[1] * 6 + [2] * (t - 6), [1] * t]), jnp.int32)
    return q, k, v, seg


@pytest.mark.parametrize("dqk,dv", [(24, 16), (16, 24), (16, 16)])
def test_cudnn_call_through_xla_matches_jnp(dqk, dv):
    """The cudnn kernel's jax.nn.dot_product_attention call (documents, causal mask, the narrower
    head zero-padded) run by XLA equals the jnp oracle: outputs, max logit and gradients."""
    q, k, v, seg = _qkv(jnp.float32, dqk=dqk, dv=dv)
    got = cudnn_attention(q, k, v, seg, scale=0.3, implementation="xla")
    want = causal_attention(q, k, v, seg, scale=0.3)
    assert got[0].shape == want[0].shape == (2, 16, 2, dv)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, seg, scale=0.3)[0] ** 2)
    xla = lambda *a, **kw: cudnn_attention(*a, **kw, implementation="xla")
    for g, w in zip(jax.grad(loss(xla), (0, 1, 2))(q, k, v), jax.grad(loss(causal_attention), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_auto_attention_picks_per_platform_and_shape():
    bf = _qkv(jnp.bfloat16)
    assert resolve_attention("auto", *bf[:3], platform="gpu") == "cudnn"
    assert resolve_attention("auto", *_qkv(jnp.float32)[:3], platform="gpu") == "blocked"    # cuDNN: no f32
    assert resolve_attention("auto", *_qkv(jnp.bfloat16, t=15)[:3], platform="gpu") == "blocked"   # odd T
    assert resolve_attention("auto", *_qkv(jnp.bfloat16, dqk=20)[:3], platform="gpu") == "blocked"  # not x8
    assert resolve_attention("auto", *bf[:3], platform="tpu") == "blocked"
    assert resolve_attention("auto", *bf[:3], platform="cpu") == "jnp"
    long = [jax.ShapeDtypeStruct((1, QUERY_BLOCK + 1, 2, 8), jnp.float32)] * 3      # past one query block
    assert resolve_attention("auto", *long, platform="cpu") == "blocked"
    assert resolve_attention("auto", *[jax.ShapeDtypeStruct((1, QUERY_BLOCK, 2, 8), jnp.float32)] * 3,
                             platform="cpu") == "jnp"
    assert resolve_attention("blocked", *bf[:3], platform="gpu") == "blocked"
    assert get_attention_fn("auto") is auto_attention
    q, k, v, seg = _qkv(jnp.float32)
    for g, w in zip(auto_attention(q, k, v, seg, scale=0.3), causal_attention(q, k, v, seg, scale=0.3)):
        np.testing.assert_array_equal(g, w)                   # on CPU: the jnp path itself


def test_auto_resolves_for_the_mesh_an_aot_compile_lowers_for():
    """Under a mesh of TPU topology devices (an ahead-of-time compile from this CPU host) every
    ``auto`` resolves for TPU, the attention call included; outside it, for the CPU."""
    from k3jax import topology as TP
    from k3jax.compile import topology_mesh
    if not TP.libtpu_available():
        pytest.skip("libtpu is not installed: no TPU topology")
    _, mesh = topology_mesh(C.load(C.REPO_CONFIGS / "base.yml", ["ici_fsdp_parallelism=4"]), "v5p:2x2x1")
    q, k, v, _ = _qkv(jnp.bfloat16)
    with jax.set_mesh(mesh):
        assert [resolve(key, "auto") for key in ("moe_ep_transport", "kda_impl", "moe_impl")] == \
            ["ragged", "chunked", "ragged_dot"]
        assert resolve_attention("auto", q, k, v) == "blocked"
    assert resolve_attention("auto", q, k, v) == "jnp" and resolve("moe_ep_transport", "auto") == "padded"


def test_auto_kda_is_the_chunked_core():
    r = np.random.default_rng(1)
    b, t, h, d = 1, 32, 2, 16
    q, k = (jnp.asarray(r.normal(size=(b, t, h, d)), jnp.float32) for _ in range(2))
    q, k = q / jnp.linalg.norm(q, axis=-1, keepdims=True), k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jnp.asarray(r.normal(size=(b, t, h, d)), jnp.float32)
    g = -jnp.asarray(r.uniform(0.01, 0.5, size=(b, t, h, d)), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(b, t, h)), jnp.float32)
    got = get_kda_fn("auto", chunk_size=16)(q, k, v, g, beta)
    want = get_kda_fn("chunked", chunk_size=16)(q, k, v, g, beta)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)


def test_cudnn_off_gpu_and_impossible_explicit_settings_are_one_line_errors():
    q, k, v, seg = _qkv(jnp.bfloat16)
    with pytest.raises(ValueError, match="attention_impl=cudnn runs cuDNN's GPU kernel but the target platform is cpu"):
        get_attention_fn("cudnn")(q, k, v, seg, scale=0.3)
    cudnn = C.load(C.REPO_CONFIGS / "base.yml", ["attention_impl=cudnn"])
    with pytest.raises(ConfigError, match="devices here are cpu; use attention_impl=auto"):
        C.validate(cudnn, num_devices=8, platform="cpu")
    with pytest.raises(ConfigError, match="takes bfloat16 or float16 activations, but dtype=float32"):
        C.validate(cudnn, num_devices=1, platform="gpu")
    C.validate(C.override(cudnn, {"dtype": "bfloat16"}), num_devices=1, platform="gpu")
    ep = ["ici_fsdp_parallelism=4", "ici_expert_parallelism=2"]
    ragged = C.load(C.REPO_CONFIGS / "base.yml", [*ep, "moe_ep_transport=ragged"])
    with pytest.raises(ConfigError, match="XLA:CPU does not implement; use moe_ep_transport=auto"):
        C.validate(ragged, num_devices=8, platform="cpu")
    C.validate(ragged, num_devices=8, platform="tpu")
    C.validate(C.load(C.REPO_CONFIGS / "base.yml", ep), num_devices=8, platform="cpu")


def test_expert_parallel_default_case_lowers_on_cpu():
    """Issue 38's case, `python -m k3jax.train configs/base.yml ici_fsdp_parallelism=4
    ici_expert_parallelism=2 steps=2` on 8 CPU devices with every kernel key at its default: its
    train step traces and lowers (it died tracing with moe_ep_transport=ragged), exchanging tokens
    with the padded all_to_all (moe_ep_transport=auto on CPU), never ragged_all_to_all. (The whole
    command trains in about 2 minutes of compiling on 2 cores: too long to run here; the lowering
    is where it failed.)"""
    from k3jax import sharding as S
    from k3jax.compile import abstract_batch
    from k3jax.state import abstract_state
    from k3jax.step import check_batch, jit_train_step
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["ici_fsdp_parallelism=4", "ici_expert_parallelism=2", "steps=2"])
    C.validate(cfg, num_devices=8, platform="cpu")
    mesh = S.make_mesh(cfg)
    assert dict(mesh.shape)["expert"] == 2 and len(jax.devices()) == 8
    gdef, state, tx = abstract_state(cfg, mesh, optimizer=True)
    with jax.set_mesh(mesh):
        hlo = jit_train_step(cfg, gdef, tx, state).lower(state, abstract_batch(cfg, mesh, check_batch(cfg, 8))).as_text()
    assert "all_to_all" in hlo and "ragged_all_to_all" not in hlo


def test_tpu_detection_and_default_platforms(tmp_path, monkeypatch):
    no_chips, chips = (lambda: 0), (lambda: 4)
    root = str(tmp_path)
    assert not runtime.tpu_visible({}, root, no_chips)
    assert runtime.tpu_visible({}, root, chips)
    assert runtime.tpu_visible({"TPU_WORKER_HOSTNAMES": "h0,h1"}, root, no_chips)
    assert not runtime.tpu_visible({"TPU_SKIP_MDS_QUERY": "1"}, root, no_chips)   # jax sets it itself
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "accel0").touch()
    assert runtime.tpu_visible({}, root, no_chips)
    (tmp_path / "dev" / "accel0").unlink()
    assert runtime.default_platforms({}, root, no_chips) == "cpu"          # libtpu is installed here
    assert runtime.default_platforms({}, root, chips) is None              # a TPU host keeps its TPU
    assert runtime.default_platforms({"JAX_PLATFORMS": "tpu"}, root, no_chips) is None
    (tmp_path / "dev" / "nvidia0").touch()
    monkeypatch.setattr(runtime, "_installed", lambda m: m in ("libtpu", "jax_plugins.xla_cuda13"))
    assert runtime.default_platforms({}, root, no_chips) == "cuda,cpu"
    monkeypatch.setattr(runtime, "_installed", lambda m: m == "libtpu")
    assert runtime.default_platforms({}, root, no_chips) is None          # a GPU but no CUDA plugin
    monkeypatch.setattr(runtime, "_installed", lambda m: False)
    assert runtime.default_platforms({}, root, no_chips) is None          # no libtpu: nothing to quiet


@pytest.mark.skipif(runtime.tpu_visible(), reason="this host has a TPU")
def test_tool_starts_quietly_on_cpu_without_jax_platforms():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    code = "import sys; from k3jax.config import main; import jax; print(jax.devices()[0].platform); main(sys.argv[1:])"
    r = subprocess.run([sys.executable, "-c", code, "configs/base.yml"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "cpu"
    for noise in ("TPU", "libtpu", "worker hostname", "InitGoogle"):
        assert noise not in r.stderr, r.stderr
