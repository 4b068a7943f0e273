"""MoonViT3d (docs/vision.md §2-§4): patch + position embedding, scanned pre-norm blocks with
fused qkv and 2-D RoPE, bidirectional attention per media item, final norm, the ``sd2_tpool``
merge and the ``patchmerger`` (K2.5) / ``patchmergerv2`` (K3) projectors.

Inputs are a packed patch sequence [N, 3*p*p] (each patch flattened (c, y, x)) and the numpy
layout of ``k3jax.data.media_layout.media_layout``; every shape is fixed by (N, merged token count).
Weights are stored [in, out] like the text layers; the q/k columns of ``wqkv`` keep the
checkpoint's interleaved RoPE pairs (pair p = columns 2p, 2p+1 of a head). Parameter names
follow the released checkpoint's (§6) so a converter maps them one to one.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.layers.common import ones, param, zeros
from k3jax.sharding import BATCH_AXES
from k3jax.vision.attention import segment_attention
from k3jax.data.media_layout import ARRAY_KEYS, temporal_table


class Norm(nnx.Module):
    """LayerNorm with bias (``layernorm``) or RMSNorm, weight only (``rmsnorm``); statistics in
    f32, the result cast back to the input dtype."""

    def __init__(self, dim: int, kind: str, eps: float, rngs, stack=(), dtype=jnp.float32):
        self.kind, self.eps = kind, eps
        self.weight = param(rngs, stack, (dim,), ("norm",), init=ones, dtype=dtype)
        if kind == "layernorm":
            self.bias = param(rngs, stack, (dim,), ("norm",), init=zeros, dtype=dtype)

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        if self.kind == "layernorm":
            xf = xf - jnp.mean(xf, -1, keepdims=True)
            y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + self.eps)
            y = y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        else:
            y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + self.eps) * self.weight[...].astype(jnp.float32)
        return y.astype(x.dtype)


def _linear(x, w, b=None):
    y = jnp.einsum("...i,io->...o", x, w[...].astype(x.dtype))
    return y if b is None else y + b[...].astype(x.dtype)


def _gelu(kind: str):
    return lambda x: jax.nn.gelu(x, approximate=(kind == "gelu_tanh"))


def rope_tables(vcfg, rows, cols):
    """cos, sin [N, Dh/2] f32 of the 2-D RoPE: pair p turns by col (p even) or row (p odd) times
    theta^(-4 floor(p/2) / Dh)."""
    dh = vcfg.vision_head_dim
    p = np.arange(dh // 2)
    freq = jnp.asarray(vcfg.vision_rope_theta ** (-4.0 * (p // 2) / dh), jnp.float32)
    pos = jnp.where(jnp.asarray(p % 2 == 0)[None, :], cols[:, None], rows[:, None]).astype(jnp.float32)
    ang = pos * freq[None, :]
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x, cos, sin):
    """x [N, H, Dh] with interleaved pairs (x[2p], x[2p+1]) rotated by the angles; f32 inside."""
    n, h, dh = x.shape
    xf = x.astype(jnp.float32).reshape(n, h, dh // 2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).reshape(n, h, dh).astype(x.dtype)


POS_CHUNK = 1024   # patches per step of the position-table gather


def _gather_taps(table, index, weight):
    """sum_k weight[n, k] * table[index[n, k]] -> [N, D] f32, POS_CHUNK patches at a time: the
    gathered [N, taps, D] block is never whole (K2.5's largest image, 16,384 patches x 16 bicubic
    taps x 1152: 1.2 GB in f32; in chunks 77 MB, XLA:CPU's temp figures)."""
    n = index.shape[0]
    c = min(POS_CHUNK, n)
    pad = -n % c
    idx = jnp.pad(index, ((0, pad), (0, 0))).reshape(-1, c, index.shape[1])
    w = jnp.pad(weight, ((0, pad), (0, 0))).reshape(-1, c, weight.shape[1])
    out = jax.lax.map(lambda a: jnp.einsum("nk,nkd->nd", a[1], jnp.take(table, a[0], axis=0)), (idx, w))
    return out.reshape(-1, table.shape[1])[:n]


class PatchEmbed(nnx.Module):
    def __init__(self, vcfg, rngs, std: float, dtype=jnp.float32):
        p, d = vcfg.vision_patch_size, vcfg.vision_hidden_size
        self.width = d
        self.proj = param(rngs, (), (3 * p * p, d), (None, "embed"), std=std, dtype=dtype, matrix=(0, 1))
        if vcfg.vision_patch_bias:
            self.proj_bias = param(rngs, (), (d,), ("norm",), init=zeros, dtype=dtype)
        self.pos_emb = param(rngs, (), (vcfg.vision_pos_emb_height, vcfg.vision_pos_emb_width, d),
                             (None, None, "embed"), std=std, dtype=dtype)
        self.max_frames = vcfg.vision_pos_emb_time
        self.add_in_f32 = vcfg.vision_pos_add_dtype == "float32"

    def __call__(self, patches, pos_index, pos_weight, frames):
        """patches [N, 3pp] -> [N, D]: proj + the table gathered at the taps (weighted sum, f32) +
        the temporal term of the patch's frame (row 0 = none)."""
        x = _linear(patches, self.proj, getattr(self, "proj_bias", None))
        table = self.pos_emb[...].astype(jnp.float32).reshape(-1, self.width)
        pos = _gather_taps(table, pos_index, pos_weight)
        pos = pos + jnp.take(jnp.asarray(temporal_table(self.width, self.max_frames)), frames, axis=0)
        if self.add_in_f32:
            return (x.astype(jnp.float32) + pos).astype(x.dtype)
        return x + pos.astype(x.dtype)


class VisionBlock(nnx.Module):
    """Pre-norm block: x += wo(attn(rope(wqkv(norm0 x)))); x += fc1(act(fc0(norm1 x)))."""

    def __init__(self, vcfg, rngs, stack, std: float, dtype=jnp.float32):
        d, q, f = vcfg.vision_hidden_size, vcfg.qkv_width, vcfg.vision_mlp_dim
        nk, eps = vcfg.vision_norm, vcfg.vision_norm_eps
        mat = dict(std=std, dtype=dtype, matrix=(0, 1))
        vec = dict(init=zeros, dtype=dtype)
        self.heads, self.head_dim = vcfg.vision_num_heads, vcfg.vision_head_dim
        self.act = _gelu(vcfg.vision_mlp_activation)
        self.norm0 = Norm(d, nk, eps, rngs, stack, dtype)
        self.wqkv = param(rngs, stack, (d, 3 * q), ("embed", "heads"), **mat)
        self.wo = param(rngs, stack, (q, d), ("heads", "embed"), **mat)
        if vcfg.vision_attn_bias:
            self.wqkv_bias = param(rngs, stack, (3 * q,), ("norm",), **vec)
            self.wo_bias = param(rngs, stack, (d,), ("norm",), **vec)
        self.norm1 = Norm(d, nk, eps, rngs, stack, dtype)
        self.fc0 = param(rngs, stack, (d, f), ("embed", "mlp"), **mat)
        self.fc1 = param(rngs, stack, (f, d), ("mlp", "embed"), **mat)
        if vcfg.vision_mlp_bias:
            self.fc0_bias = param(rngs, stack, (f,), ("norm",), **vec)
            self.fc1_bias = param(rngs, stack, (d,), ("norm",), **vec)

    def __call__(self, x, cos, sin, segment_ids, attention):
        n = x.shape[0]
        with jax.named_scope("attention"):
            qkv = _linear(self.norm0(x), self.wqkv, getattr(self, "wqkv_bias", None))
            qkv = qkv.reshape(n, 3, self.heads, self.head_dim)
            q, k = apply_rope(qkv[:, 0], cos, sin), apply_rope(qkv[:, 1], cos, sin)
            o = attention(q, k, qkv[:, 2], segment_ids, scale=self.head_dim ** -0.5)
            x = x + _linear(o.reshape(n, -1), self.wo, getattr(self, "wo_bias", None))
        with jax.named_scope("mlp"):
            h = self.act(_linear(self.norm1(x), self.fc0, getattr(self, "fc0_bias", None)))
            return x + _linear(h, self.fc1, getattr(self, "fc1_bias", None))


class VisionTower(nnx.Module):
    """Patches [N, 3pp] + layout -> final-normed hidden states [N, D]."""

    def __init__(self, vcfg, rngs, *, std: float = 0.02, dtype=jnp.float32, compute_dtype=jnp.float32,
                 interpret: bool = False):
        self.vcfg, self.compute_dtype = vcfg, compute_dtype
        self.attention = segment_attention(vcfg, interpret)
        self.patch_embed = PatchEmbed(vcfg, rngs, std, dtype)
        self.blocks = VisionBlock(vcfg, rngs, (vcfg.vision_num_layers,), std, dtype)
        self.final_layernorm = Norm(vcfg.vision_hidden_size, vcfg.vision_norm, vcfg.vision_norm_eps, rngs, (), dtype)

    def __call__(self, patches, layout, *, remat: bool = False, per_layer: bool = False):
        """-> hidden [N, D] (with ``per_layer``: also every block's output, [L, N, D], before the final norm)."""
        with jax.named_scope("patch_embed"):
            x = self.patch_embed(patches.reshape(patches.shape[0], -1).astype(self.compute_dtype),
                                 layout["pos_index"], layout["pos_weight"], layout["frames"])
        cos, sin = rope_tables(self.vcfg, layout["rows"], layout["cols"])
        seg = layout["segment_ids"]
        gdef, state = nnx.split(self.blocks)

        def body(x, st):
            x = nnx.merge(gdef, st)(x, cos, sin, seg, self.attention)
            return x, (x if per_layer else None)

        if remat:
            body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
        x, layers = jax.lax.scan(body, x, state)
        out = self.final_layernorm(x)
        return (out, layers) if per_layer else out


def merge_patches(hidden, layout):
    """sd2_tpool: hidden [N, D] -> [M, k*k, D], each sub-patch the mean of its frames (the
    layout's gather indices and 1/t weights; padding tokens are zero)."""
    g = jnp.take(hidden, layout["merge_index"], axis=0)                  # [M, k*k, T, D]
    w = layout["merge_weight"].astype(jnp.float32)[..., None]
    return jnp.sum(g.astype(jnp.float32) * w, axis=2).astype(hidden.dtype)


class Projector(nnx.Module):
    """Merged [M, k*k, D] -> text embeddings [M, text_hidden].

    patchmerger (K2.5): LayerNorm(D) on each sub-patch, concat, Linear+b, GELU(erf), Linear+b.
    patchmergerv2 (K3): concat, Linear, GELU(erf), Linear (no biases), RMSNorm(text_hidden)."""

    def __init__(self, vcfg, text_hidden: int, rngs, *, std: float = 0.02, dtype=jnp.float32):
        self.kind, eps = vcfg.vision_projector, vcfg.vision_projector_eps
        d_in, hid = vcfg.merged_width, vcfg.projector_hidden
        mat = dict(std=std, dtype=dtype, matrix=(0, 1))
        v1 = self.kind == "patchmerger"
        if v1:
            self.pre_norm = Norm(vcfg.vision_hidden_size, "layernorm", eps, rngs, (), dtype)
        self.proj0 = param(rngs, (), (d_in, hid), ("embed", "mlp"), **mat)
        self.proj2 = param(rngs, (), (hid, text_hidden), ("mlp", "embed"), **mat)
        if v1:
            self.proj0_bias = param(rngs, (), (hid,), ("norm",), init=zeros, dtype=dtype)
            self.proj2_bias = param(rngs, (), (text_hidden,), ("norm",), init=zeros, dtype=dtype)
        else:
            self.post_norm = Norm(text_hidden, "rmsnorm", eps, rngs, (), dtype)

    def __call__(self, merged):
        x = self.pre_norm(merged) if self.kind == "patchmerger" else merged
        x = x.reshape(x.shape[0], -1)
        x = jax.nn.gelu(_linear(x, self.proj0, getattr(self, "proj0_bias", None)), approximate=False)
        x = _linear(x, self.proj2, getattr(self, "proj2_bias", None))
        return x if self.kind == "patchmerger" else self.post_norm(x)


class VisionEncoder(nnx.Module):
    """The tower and the projector under the checkpoint's two roots (vision_tower, mm_projector)."""

    def __init__(self, vcfg, text_hidden: int, rngs, *, std: float = 0.02, dtype=jnp.float32,
                 compute_dtype=jnp.float32, interpret: bool = False):
        self.vision_tower = VisionTower(vcfg, rngs, std=std, dtype=dtype, compute_dtype=compute_dtype,
                                        interpret=interpret)
        self.mm_projector = Projector(vcfg, text_hidden, rngs, std=std, dtype=dtype)

    def __call__(self, patches, layout, *, remat: bool = False):
        """patches [N, 3pp] + layout arrays -> features [M, text_hidden] (M = the token bucket;
        rows past the layout's real tokens are padding).

        Grouped media, patches [G, N, 3pp] with every layout array led by G (each group its own
        packed sequence and layout, e.g. one group per batch row) -> [G, M, text_hidden]: on a
        mesh the groups are split over the batch axes like the rows (``jax.shard_map``), so each
        device encodes its own groups with the whole weights (gathered first when they are
        sharded; their gradients summed over the devices) and attention never spans two groups.
        Left to GSPMD, the vmapped tower's activations were not kept split by group: the K3 VL
        step for v5p-2048 asked for 249 GiB of temporaries per device."""
        if patches.ndim == 3:
            return self._grouped(patches, {k: layout[k] for k in ARRAY_KEYS}, remat)
        hidden = self.vision_tower(patches, layout, remat=remat)
        with jax.named_scope("merge"):
            merged = merge_patches(hidden, layout)
        with jax.named_scope("projector"):
            return self.mm_projector(merged)

    def _grouped(self, patches, layout, remat: bool):
        gdef, state = nnx.split(self)

        def run(state, patches, layout):
            enc = nnx.merge(gdef, state)
            return jax.vmap(lambda x, lay: enc(x, lay, remat=remat))(patches, layout)

        mesh = jax.sharding.get_abstract_mesh()
        axes = () if mesh.empty else tuple(a for a in BATCH_AXES if a in mesh.shape and a not in mesh.manual_axes)
        if not axes:
            return run(state, patches, layout)
        n = int(np.prod([mesh.shape[a] for a in axes]))
        if patches.shape[0] % n:
            raise ValueError(f"{patches.shape[0]} media groups do not split over the {n} devices of the batch "
                             f"axes {axes}; give one group per batch row")
        rows = jax.sharding.PartitionSpec(axes)
        return jax.shard_map(run, mesh=mesh, in_specs=(jax.sharding.PartitionSpec(), rows, rows), out_specs=rows,
                             axis_names=frozenset(axes), check_vma=False)(state, patches, layout)
