"""The device side of the server: the slot cache and the few compiled programs that touch it.

``serve_max_batch`` slots share one decode cache (``model.cache_spec(B, S)`` with S =
max_target_length): slot b owns row b of every leaf, its KDA recurrent + conv state and its MLA
latent cache region. Three kinds of program run on it, each compiled once, ahead of time, at start:

- ``decode``: one token for every slot at its own position (``model.decode_step`` with per-row
  ``pos``). Idle rows (free, or still prefilling) leave their cache untouched: their MLA write goes
  to slot S (dropped) and their KDA leaves are selected back.
- ``prefill[C]``: the next C prompt tokens of one slot (``model.extend`` on that row), for each C
  in the bucket list (powers of two up to ``serve_prefill_chunk``): a bounded set of shapes, so no
  request ever triggers a compilation. The chunk's last real token gives the first sampled token.
- ``reset``: zero one slot's rows when its request ends, so a slot always starts from zeros.

Each program samples on device (per-row temperature / top-k / top-p and a key folded from the
request's seed and its token count, so a request's samples do not depend on its neighbours) and
returns token ids, their log-probabilities and the top ``TOP_LOGPROBS`` alternatives, replicated
on every device, so any process can read them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.sampling import logprobs, sample_rows
from k3jax.sharding import sharding_for

TOP_LOGPROBS = 20   # OpenAI's upper bound for chat top_logprobs (completions allow 5)
MIN_BUCKET = 32


def prefill_buckets(chunk: int) -> list[int]:
    """Compiled prefill chunk lengths: powers of two from MIN_BUCKET below ``chunk``, and ``chunk``."""
    out, c = [], MIN_BUCKET
    while c < chunk:
        out.append(c)
        c *= 2
    return out + [chunk]


def _is_spec_leaf(x) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], tuple)


def _keys(seeds, counters):
    """One PRNG key per row: the request's seed folded with its number of sampled tokens."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)


class Programs:
    """The slot cache and the compiled decode / prefill / reset programs of one model.

    ``model`` holds the (sharded) weights; ``slots`` = B, ``length`` = S (cache positions per slot).
    Calls take numpy inputs (the same values on every process) and return numpy outputs.
    """

    def __init__(self, model, mesh, *, slots: int, length: int, chunk: int):
        self.mesh, self.slots, self.length = mesh, slots, length
        self.buckets = prefill_buckets(chunk)
        self.gdef, params, rest = nnx.split(model, nnx.Param, ...)
        self.state = (params, rest)
        spec = model.cache_spec(slots, length)
        leaves, self._tdef = jax.tree.flatten(spec, is_leaf=_is_spec_leaf)
        self._batch_axis = [axes.index("batch") for _, _, axes in leaves]
        # KDA leaves hold state that an idle row must keep; MLA leaves ("c", "k_r") are only
        # written at the row's own slot, which an idle row points past the end.
        paths = jax.tree_util.tree_flatten_with_path(spec, is_leaf=_is_spec_leaf)[0]
        self._recurrent = [str(getattr(p[-1], "key", "")) not in ("c", "k_r") for p, _ in paths]
        self.cache_shardings = [sharding_for(mesh, shape, axes) for shape, _, axes in leaves]
        self.replicated = NamedSharding(mesh, P())
        self._zeros = jax.jit(lambda: [jnp.zeros(s, d) for s, d, _ in leaves], out_shardings=self.cache_shardings)
        self.cache = self._zeros()
        self._multi = jax.process_count() > 1
        with jax.set_mesh(mesh):
            self._decode = self._compile(self._decode_fn, self._decode_args())
            self._prefill = {c: self._compile(self._prefill_fn, self._prefill_args(c)) for c in self.buckets}
            self._reset = self._compile(self._reset_fn, [jax.ShapeDtypeStruct((), jnp.int32)])

    # -- tracing --------------------------------------------------------------------------------
    def _model(self, state):
        return nnx.merge(self.gdef, *state)

    def _rows(self, new, old, active):
        """new where the row is active, else old, for the recurrent (KDA) leaves."""
        out = []
        for n, o, ax, rec in zip(new, old, self._batch_axis, self._recurrent):
            if rec:
                shape = [1] * n.ndim
                shape[ax] = n.shape[ax]
                n = jnp.where(active.reshape(shape), n, o)
            out.append(n)
        return out

    def _decode_fn(self, state, cache, tokens, pos, active, temperature, top_k, top_p, seeds, counters):
        b = tokens.shape[0]
        write = jnp.where(active, pos, self.length)                # idle rows write past the end
        tree = jax.tree.unflatten(self._tdef, cache)
        logits, new = self._model(state).decode_step(tokens, tree, write, jnp.zeros((b,), jnp.int32))
        new = self._rows(jax.tree.leaves(new), cache, active)
        tok = sample_rows(logits, _keys(seeds, counters), temperature, top_k, top_p)
        return (tok, *logprobs(logits, tok, self._k(logits))), new

    def _prefill_fn(self, state, cache, slot, tokens, pos, length, temperature, top_k, top_p, seed, counter):
        row = [jax.lax.dynamic_slice_in_dim(x, slot, 1, ax) for x, ax in zip(cache, self._batch_axis)]
        logits, new = self._model(state).extend(tokens[None], jax.tree.unflatten(self._tdef, row), pos[None],
                                                length[None])
        cache = [jax.lax.dynamic_update_slice_in_dim(x, r.astype(x.dtype), slot, ax)
                 for x, r, ax in zip(cache, jax.tree.leaves(new), self._batch_axis)]
        tok = sample_rows(logits, _keys(seed[None], counter[None]), temperature[None], top_k[None], top_p[None])
        return (tok, *logprobs(logits, tok, self._k(logits))), cache

    def _reset_fn(self, state, cache, slot):
        del state
        return [jax.lax.dynamic_update_slice_in_dim(x, jnp.zeros_like(jax.lax.dynamic_slice_in_dim(x, 0, 1, ax)),
                                                    slot, ax) for x, ax in zip(cache, self._batch_axis)]

    @staticmethod
    def _k(logits):
        return min(TOP_LOGPROBS, logits.shape[-1])

    # -- compilation ----------------------------------------------------------------------------
    def _decode_args(self):
        b, i32, f32 = self.slots, jnp.int32, jnp.float32
        return [jax.ShapeDtypeStruct((b,), dt) for dt in (i32, i32, jnp.bool_, f32, i32, f32, jnp.uint32, i32)]

    def _prefill_args(self, c):
        scalars = (jnp.int32, jnp.int32, jnp.int32, jnp.float32, jnp.int32, jnp.float32, jnp.uint32, jnp.int32)
        return ([jax.ShapeDtypeStruct((), scalars[0]), jax.ShapeDtypeStruct((c,), jnp.int32)]
                + [jax.ShapeDtypeStruct((), dt) for dt in scalars[1:]])

    def _compile(self, fn, host_args):
        abstract_cache = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                          for x, s in zip(self.cache, self.cache_shardings)]
        host = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.replicated) for a in host_args]
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)
        # Host outputs replicated (any process reads its own copy whole); the cache keeps its layout.
        out = self.cache_shardings if fn == self._reset_fn else (self.replicated, self.cache_shardings)
        jitted = jax.jit(fn, donate_argnums=1, out_shardings=out)
        return jitted.lower(state, abstract_cache, *host).compile()

    # -- calls (numpy in, numpy out) ------------------------------------------------------------
    def _put(self, x):
        x = np.asarray(x)
        if self._multi:
            return jax.make_array_from_process_local_data(self.replicated, x)
        return jax.device_put(x, self.replicated)

    @staticmethod
    def _get(x):
        return np.asarray(x.addressable_data(0))   # replicated: this process's copy is the whole array

    def decode(self, tokens, pos, active, temperature, top_k, top_p, seeds, counters):
        """One decode step for all slots; every argument is [B]. -> (tokens, logprob, top ids, top
        logprobs) as numpy arrays over the slots (rows of idle slots are meaningless)."""
        args = [self._put(a) for a in (tokens, pos, active, temperature, top_k, top_p, seeds, counters)]
        out, self.cache = self._decode(self.state, self.cache, *args)
        return tuple(self._get(o) for o in out)

    def prefill(self, slot, tokens, pos, temperature, top_k, top_p, seed, counter):
        """Prefill ``tokens`` (at most the largest bucket) into ``slot`` after its first ``pos``
        tokens -> the token sampled after the last one (and its log-probabilities), as for decode."""
        n = len(tokens)
        c = next(b for b in self.buckets if b >= n)
        padded = np.zeros(c, np.int32)
        padded[:n] = tokens
        args = [self._put(np.asarray(v, dt)) for v, dt in (
            (slot, np.int32), (padded, np.int32), (pos, np.int32), (n, np.int32), (temperature, np.float32),
            (top_k, np.int32), (top_p, np.float32), (seed, np.uint32), (counter, np.int32))]
        out, self.cache = self._prefill[c](self.state, self.cache, *args)
        return tuple(self._get(o)[0] for o in out)

    def reset(self, slot: int):
        """Zero slot ``slot``'s rows of every cache leaf."""
        self.cache = self._reset(self.state, self.cache, self._put(np.asarray(slot, np.int32)))

    def row(self, slot: int):
        """Slot ``slot``'s cache rows as numpy arrays (tests: a freed slot is all zeros)."""
        return [np.take(np.asarray(jax.device_get(x)), slot, axis=ax) for x, ax in zip(self.cache, self._batch_axis)]
