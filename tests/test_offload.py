"""Remat policies that offload activations to host memory (k3jax.remat; issue 53, item 1).

The offload itself cannot run here: XLA:CPU has no host memory apart from its device memory and
compiles the offload away. So the train step is compiled for a v5p topology with libtpu from this
CPU host, where the compiled program shows it, and on CPU each offload policy's device-only
equivalent (the same names kept in HBM: the same recompute) is checked against no remat. That the
offload holds less HBM than its device-only equivalent needs larger activations than the tiny
model's, so that pair of compiles runs with K3JAX_SLOW_TESTS=1.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import randomize
from k3jax import compile as K
from k3jax import config as C
from k3jax import model as M
from k3jax import plan as PL
from k3jax import remat as R
from k3jax import roofline as RL
from k3jax import topology as TP
from k3jax import train

TINY4 = ["model_name=tiny", "num_layers=4", "mla_extra_layers=[]", "attn_res_block_size=2", "opt_type=adamw",
         "use_qk_clip=false"]
OFFLOAD_POLICIES = ["offload_mixer_out", "offload_kda"]


@pytest.mark.parametrize("args,message", [
    (["remat_policy=custom", "remat_offload_names=[mixer_out, attn_out]"],
     "attn_out tagged by no layer of this model (known names: ffn_out, kda_chunk_states, kda_core_out, mixer_out)"),
    (["remat_policy=offload_kda", "kda_impl=reference"], "kda_chunk_states tagged by no layer"),
    (["remat_policy=offload_kda", "mla_every=1", "mla_extra_layers=[]"], "no KDA layer"),
    (["remat_offload_names=[mixer_out]"], "read only with remat_policy=custom"),
    (["remat_policy=custom", "remat_save_names=[ffn_out]", "remat_offload_names=[ffn_out]"],
     "both saved on device and offloaded"),
])
def test_remat_name_mistakes_are_one_line(args, message):
    with pytest.raises(C.ConfigError) as e:
        C.load_from_argv(TINY4 + args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_offload_on_cpu_is_refused_at_run_time(capsys):
    """train on this CPU with an offload policy: exit 2 and one error line naming the device-only
    equivalent, before anything is built; the same config validates for a TPU (AOT compiles)."""
    assert train.main(TINY4 + ["remat_policy=offload_kda", "steps=1", "enable_checkpointing=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: remat_policy=offload_kda offloads to pinned_host memory")
    assert "remat_policy=custom remat_save_names=[mixer_out,kda_core_out,kda_chunk_states]" in err[0]
    C.validate(C.load_from_argv(TINY4 + ["remat_policy=offload_kda"]), platform="tpu")


def test_device_only_equivalents():
    cfg = C.load_from_argv(TINY4 + ["remat_policy=offload_mixer_out"])
    assert R.device_only(cfg.train)["remat_policy"] == "save_mixer_out"
    assert R.spec(cfg.train) == R.Custom((), ("mixer_out",))
    cfg = C.load_from_argv(TINY4 + ["remat_policy=custom", "remat_save_names=[ffn_out]",
                                    "remat_offload_names=[kda_chunk_states]"])
    assert R.device_only(cfg.train) == {"remat_policy": "custom", "remat_save_names": ["ffn_out", "kda_chunk_states"],
                                        "remat_offload_names": []}


def test_device_only_equivalents_give_the_gradients_of_no_remat():
    """Each offload policy's device-only equivalent recomputes what the offload policy recomputes;
    on CPU its loss gradients equal remat_policy=none's within 1e-6 (scanned periods, unrolled
    prefix, KDA with its custom_vjp, MLA, MoE, AttnRes)."""
    cfg = C.load_from_argv(TINY4 + ["kda_chunk_size=16"])
    model = randomize(M.build(cfg, 0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.model.vocab_size, (2, 24)))
    segments = jnp.asarray(np.repeat([[1] * 13 + [2] * 11], 2, 0))

    def grads(remat):
        def loss(m):
            h, _, _ = m.hidden(tokens, segments, remat=remat)
            return jnp.mean(h * jnp.cos(jnp.arange(h.shape[-1])))
        return jax.tree.leaves(nnx.state(nnx.jit(nnx.grad(loss))(model)))

    ref = grads("none")
    for policy in OFFLOAD_POLICIES:
        twin = C.override(cfg, {"remat_policy": policy})
        twin = C.override(twin, R.device_only(twin.train))
        assert not R.offloads(twin.train)
        for a, b in zip(grads(R.spec(twin.train)), ref):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6, err_msg=policy)


def compile_for_v5p(cfg):
    """The train step compiled for v5p:2x2x1 with libtpu; -> (memory report, copies to host per
    name in the traced step, the compiled program's host buffers and async copies)."""
    if not TP.libtpu_available():
        pytest.skip("libtpu is not installed: no TPU compiler")
    topo, mesh = K.topology_mesh(cfg, "v5p:2x2x1")
    moves = {}
    compiled, _, _ = K.compile_train(cfg, mesh, on_trace=lambda jx: moves.update(K.host_moves(jx)))
    return K.memory_report(compiled, topo.chip.hbm_bytes), moves, K.host_copies(compiled)


V5P = TINY4 + ["compile_topology=v5p:2x2x1", "ici_fsdp_parallelism=4", "remat_policy=offload_kda"]


def test_offload_compiles_for_v5p_and_moves_the_named_tensors_to_host():
    """One compile (about 40 s of CPU): every offloaded name, the KDA chunk states from inside the
    core's custom_vjp forward included, is copied to host memory once per layer that tags it, per
    step (4 layers, 3 of them KDA); the compiled program holds them in host memory (S(5)) and moves
    them by async copies; memory_analysis counts host bytes."""
    mem, moves, copies = compile_for_v5p(C.load_from_argv(V5P))
    assert {k: v["moves"] for k, v in moves.items()} == {"mixer_out": 4, "kda_core_out": 3, "kda_chunk_states": 3}
    assert all(v["bytes"] > 0 for v in moves.values())
    assert copies["host_memory_space"] > 0 and copies["copy_start"] > 0
    assert mem["host_temporaries"] > 0


@pytest.mark.skipif(not os.environ.get("K3JAX_SLOW_TESTS"), reason=(
    "two compiles of about 95 s of CPU each; run with K3JAX_SLOW_TESTS=1"))
def test_offload_holds_less_hbm_than_its_device_only_equivalent():
    """offload_kda against the policy keeping the same three names in HBM, at 64 rows x 64 tokens
    per device and D = 256, where the saved tensors outweigh the async copies' staging buffers
    (268.32 against 272.44 MiB, benchmarks/offload_policies.py; with 2 or 16 rows per device the
    offload's device temporaries came out 0.02-1.2 MB above its equivalent's)."""
    cfg = C.load_from_argv(V5P + ["hidden_size=256", "per_device_batch_size=64"])
    mem, _, _ = compile_for_v5p(cfg)
    twin_mem, twin_moves, twin_copies = compile_for_v5p(C.override(cfg, R.device_only(cfg.train)))
    assert twin_moves == {} and twin_copies["host_memory_space"] == 0 and twin_mem["host_temporaries"] == 0
    assert mem["temporaries"] < twin_mem["temporaries"]


def test_host_transfer_term_in_the_roofline():
    """host bytes out and back at the chip's host link (v5p 15 GB/s per chip, one way); a chip whose
    host link is unknown leaves the term out and says so."""
    v5p, tpu7x = TP.CHIPS["v5p"], TP.CHIPS["tpu7x"]
    cfg = C.load_from_argv(TINY4 + ["gradient_accumulation_steps=2", "remat_policy=offload_mixer_out"])
    host = RL.host_transfer_bytes(cfg, {"host_temporaries": 3e9})
    assert host == 2 * 3e9 * 2
    r = RL.roofline(1e12, 1e9, v5p, host_bytes=host)          # compute 2.2 ms, HBM 0.4 ms, host 0.8 s
    assert r["t_host"] == pytest.approx(12e9 / 15e9) and r["step_s"] == r["t_host"]
    assert r["exposed_s"] == pytest.approx(r["t_host"] - 1e12 / v5p.peak_flops)
    assert RL.roofline(1e12, 1e9, v5p)["t_host"] == 0.0
    assert RL.roofline(1e15, 1e9, v5p, host_bytes=host)["step_s"] == pytest.approx(1e15 / v5p.peak_flops)
    unknown = RL.roofline(1e12, 1e9, tpu7x, host_bytes=host)
    assert unknown["host_unknown"] and unknown["t_host"] == 0.0
    # the planner's estimate: an offload candidate whose host traffic dominates ranks below one without
    cost = {"flops": 0.0, "bytes": 1e9}
    slow = RL.train_estimate(cfg, 8, 4, v5p, cost, host_bytes=host)
    fast = RL.train_estimate(cfg, 8, 4, v5p, cost)
    assert slow["t_host"] > 0 and slow["tokens_per_s_per_chip"] < fast["tokens_per_s_per_chip"]
    row = lambda remat, est, host: {"ici_expert_parallelism": 1, "ici_data_parallelism": 1, "remat_policy": remat,  # noqa: E731
                                    "per_device_batch_size": 2.0, "mesh": "fsdp=4", "global_batch": 8, "estimate": est,
                                    "memory": {"total": 2**30, "hbm": 95 * 2**30, "fits": True, "host_temporaries": host}}
    lines = PL.table([row("offload_mixer_out", slow, 3e9), row("save_mixer_out", fast, 0)], 64).splitlines()
    assert "host GiB" in lines[0] and "save_mixer_out" in lines[2] and "offload_mixer_out" in lines[3]
    assert lines[3].split()[-2:] == ["2.79", f"{slow['t_host']:.3f}"]
