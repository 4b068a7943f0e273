"""An independent float64 numpy reference of the MoonViT3d tower, the sd2_tpool merge and both
projectors, written from docs/vision.md §2-§4 with its switches. It shares no code with k3jax:
parameters come in the released checkpoint's names and layout (§6: weights [out, in], the patch
embedding as a [D, 3, p, p] convolution, q/k rows in the interleaved RoPE order), the position table
is resampled by the matrix form A_h T A_w^T, the RoPE rotates complex numbers, and attention runs
one media item at a time on its own patches (no masks).

``cfg`` is any object with the ``vision_*`` attributes of k3jax's config (read by name).
"""
from __future__ import annotations

import math

import numpy as np

_erf = np.vectorize(math.erf)


def gelu_erf(x):
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def keys_cubic(d, a=-0.75):
    d = abs(d)
    if d <= 1:
        return (a + 2) * d ** 3 - (a + 3) * d ** 2 + 1
    if d < 2:
        return a * d ** 3 - 5 * a * d ** 2 + 8 * a * d - 4 * a
    return 0.0


def resample_matrix(n, src, mode):
    """A [n, src]: row i samples the source at (i + 0.5) * src / n - 0.5, taps clamped to the edge."""
    A = np.zeros((n, src))
    for i in range(n):
        s = (i + 0.5) * src / n - 0.5
        f = math.floor(s)
        taps = range(f, f + 2) if mode == "bilinear" else range(f - 1, f + 3)
        for j in taps:
            wgt = max(0.0, 1 - abs(s - j)) if mode == "bilinear" else keys_cubic(s - j)
            A[i, min(max(j, 0), src - 1)] += wgt
    return A


def norm(cfg, x, p, name):
    if cfg.vision_norm == "layernorm":
        return layer_norm(x, p[name + ".weight"], p[name + ".bias"], cfg.vision_norm_eps)
    return rms_norm(x, p[name + ".weight"], cfg.vision_norm_eps)


def linear(x, p, name, bias):
    y = x @ p[name + ".weight"].T
    return y + p[name + ".bias"] if bias else y


def embed(cfg, p, patches, grid):
    """Patch embedding + resampled table + temporal term, per media: list of [t*h*w, D]."""
    D = cfg.vision_hidden_size
    w = p["vision_tower.patch_embed.proj.weight"]                     # [D, 3, p, p]
    table = p["vision_tower.patch_embed.pos_emb.weight"]              # [H0, W0, D]
    out, start = [], 0
    for t, h, wd in grid:
        n = t * h * wd
        x = np.einsum("ncyx,dcyx->nd", patches[start:start + n], w)   # the convolution at stride p
        if cfg.vision_patch_bias:
            x = x + p["vision_tower.patch_embed.proj.bias"]
        Ah = resample_matrix(h, table.shape[0], cfg.vision_pos_interp)
        Aw = resample_matrix(wd, table.shape[1], cfg.vision_pos_interp)
        e2 = np.einsum("ia,abd,jb->ijd", Ah, table, Aw).reshape(h * wd, D)
        pos = np.tile(e2, (t, 1))
        if t > 1:
            omega = 10000.0 ** (-2 * np.arange(D // 2) / D)
            frames = np.repeat(np.arange(t), h * wd)[:, None] * omega
            pos = pos + np.concatenate([np.sin(frames), np.cos(frames)], -1)
        out.append(x + pos)
        start += n
    return out


def rope(cfg, x, h, wd):
    """x [n, H, Dh] in checkpoint order: pair p = (x[2p], x[2p+1]) turns by col (p even) / row (p odd)."""
    dh = x.shape[-1]
    n = x.shape[0]
    idx = np.arange(n) % (h * wd)
    row, col = idx // wd, idx % wd
    p = np.arange(dh // 2)
    theta = cfg.vision_rope_theta ** (-4 * (p // 2) / dh)
    pos = np.where(p % 2 == 0, col[:, None], row[:, None])
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * pos * theta)[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def block(cfg, p, i, x, h, wd):
    pre = f"vision_tower.encoder.blocks.{i}."
    H, dh = cfg.vision_num_heads, cfg.vision_head_dim
    qkv = linear(norm(cfg, x, p, pre + "norm0"), p, pre + "wqkv", cfg.vision_attn_bias)
    qkv = qkv.reshape(x.shape[0], 3, H, dh)
    q, k, v = rope(cfg, qkv[:, 0], h, wd), rope(cfg, qkv[:, 1], h, wd), qkv[:, 2]
    s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(dh)
    s = np.exp(s - s.max(-1, keepdims=True))
    a = np.einsum("hqk,khd->qhd", s / s.sum(-1, keepdims=True), v).reshape(x.shape[0], H * dh)
    x = x + linear(a, p, pre + "wo", cfg.vision_attn_bias)
    act = gelu_tanh if cfg.vision_mlp_activation == "gelu_tanh" else gelu_erf
    hid = act(linear(norm(cfg, x, p, pre + "norm1"), p, pre + "mlp.fc0", cfg.vision_mlp_bias))
    return x + linear(hid, p, pre + "mlp.fc1", cfg.vision_mlp_bias)


def tower(cfg, p, patches, grid, per_layer=False):
    """patches [N, 3, p, p], grid [(t, h, w)] -> per media the final-normed [t*h*w, D] (and, with
    per_layer, each layer's output per media)."""
    xs = embed(cfg, p, patches, grid)
    layers = [xs]
    for i in range(cfg.vision_num_layers):
        xs = [block(cfg, p, i, x, h, wd) for x, (t, h, wd) in zip(xs, grid)]
        layers.append(xs)
    out = [norm(cfg, x, p, "vision_tower.encoder.final_layernorm") for x in xs]
    return (out, layers) if per_layer else out


def merge(cfg, xs, grid):
    """sd2_tpool: per media [(h/k)(w/k), k*k, D], sub-patches row-major, mean over frames; concatenated."""
    k = cfg.vision_merge_kernel_size
    out = []
    for x, (t, h, wd) in zip(xs, grid):
        y = x.reshape(t, h // k, k, wd // k, k, -1).transpose(0, 1, 3, 2, 4, 5).mean(0)
        out.append(y.reshape((h // k) * (wd // k), k * k, -1))
    return np.concatenate(out, 0)


def projector(cfg, p, merged):
    """merged [M, k*k, D] -> [M, text width]."""
    eps = cfg.vision_projector_eps
    if cfg.vision_projector == "patchmerger":
        x = layer_norm(merged, p["mm_projector.pre_norm.weight"], p["mm_projector.pre_norm.bias"], eps)
        x = x.reshape(x.shape[0], -1)
        x = gelu_erf(linear(x, p, "mm_projector.proj.0", True))
        return linear(x, p, "mm_projector.proj.2", True)
    x = gelu_erf(linear(merged.reshape(merged.shape[0], -1), p, "mm_projector.proj.0", False))
    return rms_norm(linear(x, p, "mm_projector.proj.2", False), p["mm_projector.post_norm.weight"], eps)


def forward(cfg, p, patches, grid):
    """-> dict of the parts: hidden (final-normed, concatenated [N, D]), merged [M, k*k, D], features [M, Dt]."""
    xs = tower(cfg, p, patches, grid)
    merged = merge(cfg, xs, grid)
    return {"hidden": np.concatenate(xs, 0), "merged": merged, "features": projector(cfg, p, merged)}
