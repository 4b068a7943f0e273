"""MLA causal attention under context parallelism: the sequence split in contiguous slices over one
mesh axis, called per shard inside a `jax.shard_map` that maps that axis.

Each shard all-gathers the compressed latent c [B, T, R], the shared rope key k_r [B, T, Rr] (576
values per token for K3, against H * (dn + dr + dv) = 96 * 320 for expanded keys and values) and
the segment ids, and attends its queries to every key at or before their global position within
their document. The per-head max logit for QK-clip is the max over shards (a pmax), so it equals
the unsharded statistic exactly.

Memory: a flash-attention form. Keys and values are never expanded for the whole sequence (at
128K tokens that is 8 GB per MLA layer in bf16, and a 512-query block's logits against every key
another 26 GB): the work is a list of (query chunk, key block) pairs walked by one `lax.scan`;
each step expands one key block of `key_block` tokens from the latent with W_kv and updates the
chunk's online-softmax accumulators. A custom VJP keeps only the output and the log-sum-exp and
walks the same pairs backwards, pushing the key/value gradients straight back through the
expansion into the latent ([T, R] f32, not [T, H, dn + dv]) and into W_kv. Temporaries are
O(query chunk x key block x heads) per step whatever the sequence length.

Work: only key blocks at or before a chunk's last query are visited. With contiguous slices shard
j would then visit j + 1 slices of keys, the last shard n times the first's. `load_balance=True`
(config `context_parallel_load_balance`) evens that inside the layer: every slice is cut in two
half chunks (2n in all), and shard j computes the queries of half chunks j and 2n - 1 - j (a
zigzag), so every shard visits (2n + 1) / 2 slices of keys, about half of what the unbalanced
last shard does. Two `ppermute`s move the query halves there and two move the outputs back
(their transposes move the gradients); nothing else about the layout changes. The key/value
expansion then costs about one expansion of the sequence per shard (R x (dn + dv) per key and
head), which next to the attention of a half chunk (dqk + dv per key, query and head) is
R (dn + dv) / ((dqk + dv) * Tl / 2) of it: 20% for K3 at 4,096 tokens per shard, 5% at 16K.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from k3jax.kernels.attention.common import NEG_INF

KEY_BLOCK = 512


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def zigzag_chunks(shard, n: int):
    """Global half-chunk indices (of 2n) shard `shard` computes with load balancing: the even one
    arrives by the first permutation, the odd one by the second -> int32 [2]."""
    low, high = shard, 2 * n - 1 - shard
    even = jnp.where(shard % 2 == 0, low, high)
    return jnp.stack([even, low + high - even]).astype(jnp.int32)


def _zigzag_perms(n: int):
    """Where each shard's first / second half goes: half chunk c lives on shard c (c < n) or
    2n - 1 - c. Both maps are permutations of the shards (c and 2n - 1 - c differ in parity)."""
    home = lambda c: c if c < n else 2 * n - 1 - c  # noqa: E731
    return ([(j, home(2 * j)) for j in range(n)], [(j, home(2 * j + 1)) for j in range(n)])


def _pairs(chunks, chunk: int, kb: int, steps: int):
    """The flat walk: step p -> (local chunk r, key block b, live). Chunk c needs key blocks
    0 .. (c + 1) * chunk / kb - 1; steps past the total (shards with less work) are dead."""
    need = (chunks + 1) * (chunk // kb)                                # key blocks per local chunk
    start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(need)[:-1]])
    p = jnp.arange(steps, dtype=jnp.int32)
    r = jnp.sum(p[:, None] >= start[None, 1:], axis=1).astype(jnp.int32)
    return r, p - start[r], p < jnp.sum(need)


def _expand(lat, k_r, kv_b, num_heads: int, nope: int):
    """lat [B,S,R], k_r [B,S,Rr], kv_b [R, H*(dn+dv)] -> k [B,S,H,dn+Rr], v [B,S,H,dv]."""
    kv = jnp.einsum("bsr,rq->bsq", lat, kv_b.astype(lat.dtype))
    kv = kv.reshape(*kv.shape[:-1], num_heads, -1)
    k_rope = jnp.broadcast_to(k_r[..., None, :], (*k_r.shape[:-1], num_heads, k_r.shape[-1]))
    return jnp.concatenate([kv[..., :nope], k_rope.astype(kv.dtype)], -1), kv[..., nope:]


def _step_logits(qc, segq, chunks, lat, k_r, kv_b, seg, r, b, live, *, chunk, kb, scale, nope):
    """One pair: chunk r's queries against key block b -> (q, k, v, logits f32, mask [B,1,c,kb])."""
    h = qc.shape[3]
    q = qc[r]
    lat_b = lax.dynamic_slice_in_dim(lat, b * kb, kb, axis=1)
    k, v = _expand(lat_b, lax.dynamic_slice_in_dim(k_r, b * kb, kb, axis=1), kv_b, h, nope)
    s = jnp.einsum("bthk,bshk->bhts", q, k, preferred_element_type=jnp.float32) * scale
    qpos = chunks[r] * chunk + jnp.arange(chunk)
    kpos = b * kb + jnp.arange(kb)
    segk = lax.dynamic_slice_in_dim(seg, b * kb, kb, axis=1)
    mask = (kpos[None, :] <= qpos[:, None])[None] & (segq[r][:, :, None] == segk[:, None, :]) & live
    return q, lat_b, k, v, s, mask[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12))
def _flash(qc, lat, k_r, kv_b, chunks, segq, seg, chunk, kb, steps, scale, nope, axis):
    o, _, m = _flash_fwd_impl(qc, lat, k_r, kv_b, chunks, segq, seg, chunk, kb, steps, scale, nope, axis)
    return o, m


def _varying(axis, *xs):
    """Scan carries start as per-shard values (shard_map's varying type) over the context axis."""
    return tuple(lax.pcast(x, axis, to="varying") for x in xs)


def _flash_fwd_impl(qc, lat, k_r, kv_b, chunks, segq, seg, chunk, kb, steps, scale, nope, axis):
    nc, b_, _, h, _ = qc.shape
    dv = kv_b.shape[1] // h - nope
    step = functools.partial(_step_logits, chunk=chunk, kb=kb, scale=scale, nope=nope)

    def body(carry, xs):
        acc, mx, den, stat = carry
        r, b, live = xs
        _, _, _, v, s, mask = step(qc, segq, chunks, lat, k_r, kv_b, seg, r, b, live)
        stat = jnp.maximum(stat, jnp.max(jnp.where(mask, s, -jnp.inf), axis=(0, 2, 3)))
        s = jnp.where(mask, s, NEG_INF)
        m_old = mx[r]
        m_new = jnp.maximum(m_old, jnp.max(s, axis=-1))                # [B,H,c]
        alpha = jnp.exp(m_old - m_new)
        p = jnp.exp(s - m_new[..., None])
        pv = jnp.einsum("bhts,bshv->bthv", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        acc = acc.at[r].set(acc[r] * jnp.swapaxes(alpha, 1, 2)[..., None] + pv)
        den = den.at[r].set(den[r] * alpha + jnp.sum(p, axis=-1))
        return (acc, mx.at[r].set(m_new), den, stat), None

    init = _varying(axis, jnp.zeros((nc, b_, chunk, h, dv), jnp.float32),
                    jnp.full((nc, b_, h, chunk), NEG_INF, jnp.float32), jnp.zeros((nc, b_, h, chunk), jnp.float32),
                    jnp.full((h,), -jnp.inf, jnp.float32))
    (acc, mx, den, stat), _ = lax.scan(body, init, _pairs(chunks, chunk, kb, steps))
    o = (acc / jnp.swapaxes(den, 2, 3)[..., None]).astype(lat.dtype)  # every query sees itself: den > 0
    return o, mx + jnp.log(den), stat


def _flash_fwd(qc, lat, k_r, kv_b, chunks, segq, seg, chunk, kb, steps, scale, nope, axis):
    o, lse, m = _flash_fwd_impl(qc, lat, k_r, kv_b, chunks, segq, seg, chunk, kb, steps, scale, nope, axis)
    return (o, m), (qc, lat, k_r, kv_b, chunks, segq, seg, o, lse)


def _flash_bwd(chunk, kb, steps, scale, nope, axis, res, cts):
    qc, lat, k_r, kv_b, chunks, segq, seg, o, lse = res
    do = cts[0].astype(jnp.float32)
    nc, _, _, h, _ = qc.shape
    delta = jnp.swapaxes(jnp.sum(do * o.astype(jnp.float32), -1), 2, 3)  # [nc,B,H,c]
    step = functools.partial(_step_logits, chunk=chunk, kb=kb, scale=scale, nope=nope)

    def body(carry, xs):
        dq, dlat, dkr, dkvb = carry
        r, b, live = xs
        q, lat_b, k, v, s, mask = step(qc, segq, chunks, lat, k_r, kv_b, seg, r, b, live)
        p = jnp.where(mask, jnp.exp(s - lse[r][..., None]), 0.0)      # [B,H,c,kb]
        dv_b = jnp.einsum("bhts,bthv->bshv", p, do[r])
        dp = jnp.einsum("bthv,bshv->bhts", do[r], v.astype(jnp.float32))
        ds = p * (dp - delta[r][..., None]) * scale
        dq = dq.at[r].add(jnp.einsum("bhts,bshk->bthk", ds, k.astype(jnp.float32)))
        dk_b = jnp.einsum("bhts,bthk->bshk", ds, q.astype(jnp.float32))  # [B,kb,H,dn+Rr]
        dkv = jnp.concatenate([dk_b[..., :nope], dv_b], -1).reshape(*dv_b.shape[:2], -1)
        dlat_b = jnp.einsum("bsq,rq->bsr", dkv, kv_b.astype(jnp.float32))
        dkvb = dkvb + jnp.einsum("bsr,bsq->rq", lat_b.astype(jnp.float32), dkv)
        add = lambda acc, x: lax.dynamic_update_slice_in_dim(  # noqa: E731
            acc, lax.dynamic_slice_in_dim(acc, b * kb, kb, axis=1) + x, b * kb, axis=1)
        return (dq, add(dlat, dlat_b), add(dkr, jnp.sum(dk_b[..., nope:], axis=2)), dkvb), None

    f32 = lambda a: jnp.zeros(a.shape, jnp.float32)  # noqa: E731
    (dq, dlat, dkr, dkvb), _ = lax.scan(body, _varying(axis, f32(qc), f32(lat), f32(k_r), f32(kv_b)),
                                        _pairs(chunks, chunk, kb, steps))
    return (dq.astype(qc.dtype), dlat.astype(lat.dtype), dkr.astype(k_r.dtype), dkvb.astype(kv_b.dtype),
            None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def mla_context_parallel_attention(q, lat, k_r, kv_b, segment_ids, *, axis_name: str, scale: float,
                                   key_block: int = KEY_BLOCK, load_balance: bool = True):
    """Causal document-masked MLA attention for this shard's queries over the whole sequence.

    Args (this shard's slice, Tl tokens of every row; shard j holds [j * Tl, (j + 1) * Tl)):
      q: [B, Tl, H, dn + Rr] queries (rope already applied to the last Rr).
      lat: [B, Tl, R] the normalised latent; k_r: [B, Tl, Rr] the rope key (rope applied).
      kv_b: [R, H * (dn + dv)] the key/value up-projection (replicated over the axis).
      segment_ids: [B, Tl] int32; a query sees keys of its own document only.
      axis_name: the mesh axis the sequence is split over; scale: the softmax scale.
      key_block: keys expanded per step (the largest divisor of the half chunk up to this).
      load_balance: zigzag the query halves so every shard does the same causal work (needs an
        even Tl; an odd one runs unbalanced).

    Returns:
      o [B, Tl, H, dv] in lat's dtype, and max_logit [H] f32: the max of the valid pre-softmax
      logits over the whole sequence, the same on every shard (no gradient).
    """
    b, t, h, dqk = q.shape
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    nope = dqk - k_r.shape[-1]
    gather = functools.partial(lax.all_gather, axis_name=axis_name, axis=1, tiled=True)
    lat_all, kr_all, seg_all = gather(lat), gather(k_r), gather(segment_ids)
    halves = t % 2 == 0
    chunk = t // 2 if halves else t
    kb = _largest_divisor(chunk, key_block)
    per = chunk // kb                                                  # key blocks per chunk
    balanced = halves and load_balance and n > 1
    if balanced:
        first, second = _zigzag_perms(n)
        qc = jnp.stack([lax.ppermute(q[:, :chunk], axis_name, first),
                        lax.ppermute(q[:, chunk:], axis_name, second)])
        chunks = zigzag_chunks(me, n)
        steps = (2 * n + 1) * per                                      # (c + 1) summed over c, 2n-1-c
    elif halves:
        qc, chunks = jnp.stack([q[:, :chunk], q[:, chunk:]]), (2 * me + jnp.arange(2)).astype(jnp.int32)
        steps = (4 * n - 1) * per                                      # the last shard's 2n-1 + 2n
    else:
        qc, chunks, steps = q[None], me[None].astype(jnp.int32), n * per
    segq = jax.vmap(lambda c: lax.dynamic_slice_in_dim(seg_all, c * chunk, chunk, axis=1))(chunks)
    # kv_b enters replicated: made per-shard here, so its gradient is summed over shards (pcast's
    # transpose) outside the custom VJP, which sees per-shard values only.
    kv_b = lax.pcast(kv_b, axis_name, to="varying")
    oc, m = _flash(qc, lat_all, kr_all, kv_b, chunks, segq, seg_all, chunk, kb, steps, scale, nope, axis_name)
    if balanced:
        inverse = lambda perm: [(dst, src) for src, dst in perm]  # noqa: E731
        o = jnp.concatenate([lax.ppermute(oc[0], axis_name, inverse(first)),
                             lax.ppermute(oc[1], axis_name, inverse(second))], axis=1)
    else:
        o = jnp.concatenate(list(oc), axis=1)
    return o, lax.pmax(lax.stop_gradient(m), axis_name)

