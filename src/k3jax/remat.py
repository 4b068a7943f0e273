"""Remat policies by name: which per-layer tensors the backward keeps on device, which it offloads to
host memory, and which it recomputes (docs/running-on-tpu-pods.md, "Offloading activations to host
memory").

The model tags its per-layer residuals with ``jax.ad_checkpoint.checkpoint_name`` (``NAMES``); a
policy is a pair (names saved on device, names offloaded to ``pinned_host``), everything else being
recomputed in the backward. ``model.remat_policy`` turns the pair into the jax policy
(``save_and_offload_only_these_names``, as MaxText's ``remat_policy=custom`` with
``tensors_to_offload``). Only names and config checks here (no jax policy objects), so the config
validator reads it.

An offloaded tensor is written to host memory in the forward and read back in the backward by async
copies; XLA:CPU has no host memory apart from its device memory and compiles the offload away, so
an offload policy is refused on a CPU at run time (``check``), while a TPU program compiled from a
CPU host (k3jax.compile, k3jax.plan) shows the host copies.
"""
from __future__ import annotations

from typing import NamedTuple

from k3jax.kernels.platform import platform_family
from k3jax.errors import ConfigError

# checkpoint_name tags in the model, each once per layer (inside the scanned period body for the
# scanned layers): name -> what it is.
NAMES = {
    "mixer_out": "each layer's mixer output (KDA or MLA after o_proj), [B, T, D] activation dtype",
    "ffn_out": "each layer's FFN output (dense MLP or MoE), [B, T, D] activation dtype",
    "kda_core_out": "each KDA layer's recurrence output before its output gate and o_proj, [B, T, H, V]",
    "kda_chunk_states": "each KDA layer's chunk-start states, T / kda_chunk_size x [K, V] f32 per head "
                        "(kda_impl auto, chunked, pallas_tpu)",
}
CHUNK_STATE_IMPLS = ("auto", "chunked", "pallas_tpu")   # the cores whose custom_vjp saves the states

# remat_policy -> (names saved on device, names offloaded to pinned_host). "none" runs without
# remat; "full" and "save_dot" (matmul outputs without batch dims) are not name lists.
PRESETS = {
    "save_mixer_out": (("mixer_out",), ()),
    "offload_mixer_out": ((), ("mixer_out",)),
    # MindSpeed-MM's skip_kda_recompute: with the KDA recurrence's output and chunk states kept
    # (on host), the backward reruns only the cheap projections around it, not the recurrence.
    "offload_kda": ((), ("mixer_out", "kda_core_out", "kda_chunk_states")),
}
NOT_NAMED = ("none", "full", "save_dot")


class Custom(NamedTuple):
    """A named policy (``remat_policy=custom`` or an offload preset): what ``model.hidden(remat=...)`` takes."""
    save: tuple
    offload: tuple


def names(train) -> tuple[tuple, tuple]:
    """(names saved on device, names offloaded) of ``train.remat_policy``."""
    p = train.remat_policy
    if p == "custom":
        return tuple(train.remat_save_names), tuple(train.remat_offload_names)
    return PRESETS.get(p, ((), ()))


def offloads(train) -> bool:
    return bool(names(train)[1])


def spec(train):
    """What the model's ``remat`` argument takes: the policy's name for the built-in jax policies
    (none, full, save_dot, save_mixer_out), else ``Custom(save, offload)``."""
    p = train.remat_policy
    if p in NOT_NAMED or p == "save_mixer_out":
        return p
    return Custom(*names(train))


def device_only(train) -> dict:
    """Config overrides of the policy that keeps on device every name ``train``'s policy saves or
    offloads (the same recompute, all in HBM): save_mixer_out for offload_mixer_out, else custom."""
    save, offload = names(train)
    if save + offload == ("mixer_out",):
        return {"remat_policy": "save_mixer_out", "remat_save_names": [], "remat_offload_names": []}
    return {"remat_policy": "custom", "remat_save_names": list(save + offload), "remat_offload_names": []}


def recompute_factor(train) -> float:
    """Executed over model FLOPs of the train step: 1 without remat or with save_dot (matmul outputs
    kept), else 4/3 (the forward runs again in the backward; the saved or offloaded names spare some
    of it, which this bound leaves out)."""
    return 1.0 if train.remat_policy in ("none", "save_dot") else 4.0 / 3.0


def defined_names(cfg) -> set:
    """The names some layer of this model tags."""
    m = cfg.model
    out = {"mixer_out", "ffn_out"} if m.num_layers else set()
    if any(m.mixer(l) == "kda" for l in range(m.num_layers)):
        out.add("kda_core_out")
        if cfg.kernel.kda_impl in CHUNK_STATE_IMPLS:
            out.add("kda_chunk_states")
    return out


def check(cfg, platform: str | None = None) -> None:
    """The policy's names against the model, and (``platform``: the devices the step runs on) an
    offload against a platform without separate host memory. One ConfigError line each."""
    t = cfg.train
    listed = list(t.remat_save_names) + list(t.remat_offload_names)
    if t.remat_policy != "custom" and listed:
        raise ConfigError(f"remat_save_names / remat_offload_names ({listed}) are read only with remat_policy=custom, "
                          f"but remat_policy={t.remat_policy}")
    save, offload = names(t)
    both = sorted(set(save) & set(offload))
    if both:
        raise ConfigError(f"remat: {both} both saved on device and offloaded; list each name in one of "
                          f"remat_save_names, remat_offload_names")
    known = defined_names(cfg)
    for key, group in (("remat_save_names", save), ("remat_offload_names", offload)):
        missing = [n for n in group if n not in known]
        if missing:
            what = f"remat_policy={t.remat_policy}" if t.remat_policy != "custom" else key
            raise ConfigError(f"{what}: {', '.join(missing)} tagged by no layer of this model "
                              f"({'kda_impl=' + cfg.kernel.kda_impl + ', ' if 'kda_chunk_states' in missing else ''}"
                              f"{'no KDA layer, ' if not any(n.startswith('kda') for n in known) else ''}"
                              f"known names: {', '.join(sorted(known))})")
    if offload and platform is not None and platform_family(platform) not in ("tpu", "gpu"):
        twin = device_only(t)
        alt = (f"remat_policy={twin['remat_policy']}" +
               (f" remat_save_names=[{','.join(twin['remat_save_names'])}]" if twin["remat_policy"] == "custom" else ""))
        raise ConfigError(f"remat_policy={t.remat_policy} offloads to pinned_host memory, which {platform} devices "
                          f"do not have apart from their own memory (XLA:{platform.upper()} compiles the offload away); "
                          f"use its device-only equivalent {alt} here, or compile for a TPU with "
                          f"python -m k3jax.compile compile_topology=...")
