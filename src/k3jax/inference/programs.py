"""The device side of the server: the slot cache and the few compiled programs that touch it.

``serve_max_batch`` slots share one decode cache (``model.cache_spec(B, S)`` with S =
max_target_length): slot b owns row b of every leaf, its KDA recurrent + conv state and its MLA
latent cache region. These programs run on it, each compiled once, ahead of time, at start:

- ``decode[N]``: up to K = ``serve_decode_steps`` decode steps for each of N slots at its own
  position (``model.decode_step`` with per-row ``pos``; a loop whose step feeds the token it sampled
  to the next, each with the next sampling key), for each N in the decode buckets
  (``serve_decode_buckets``: by default the powers of two up to B, and B). The step count is an
  argument (1 <= n <= K), so one program per bucket serves both the engine's single steps (a row
  can join after every token) and its K-step runs while no prompt is waiting or prefilling (a
  steady batch pays the host's per-step work, dispatch, reading the tokens, streaming them, once
  per K tokens); a program per step count would double the decode compiles at start. A call runs
  the smallest bucket that holds the generating slots: it gathers those slots' rows (padded with
  idle slots) once, decodes them and scatters back once the KDA leaves whole and the MLA leaves'
  n new positions. Idle rows leave their cache untouched: their MLA writes go to slot S (dropped)
  and their KDA leaves are selected back.
- ``prefill[C]``: the next C prompt tokens of one slot (``model.extend`` on that row), for each C
  in the bucket list (powers of two up to ``serve_prefill_chunk``): a bounded set of shapes, so no
  request ever triggers a compilation. The chunk's last real token gives the first sampled token.
- ``prefill_rows[R]``: a chunk of each of R prompts in one step (R in the row buckets: powers of
  two from 2 up to ``prefill_rows``, at most B), each chunk padded to ``serve_prefill_chunk``: it
  gathers those slots' rows (padded with idle slots, left unchanged), runs ``model.extend`` on the
  R x chunk tokens and scatters the rows back. A burst of new requests so prefills R at a time, at
  the batched matmuls' speed, with one decode step per R chunks instead of one per chunk.
- ``reset``: zero one slot's rows when its request ends, so a slot always starts from zeros.
- ``copy``: one slot's rows of every leaf into another (the n copies of a request share its prefill).
- ``prefill_lp``: ``prefill`` in the largest chunk that also returns every position's
  log-probability of the next prompt token and its top alternatives (completions ``echo``).
- with images (a vision model, ``media``): ``tower[N]`` runs the vision tower and projector on one
  request's images packed into N patches, for each N in the patch buckets (``media_buckets``), and
  keeps the projected rows on device (``self.media``) under an id the engine chooses;
  ``prefill_media[C]`` is ``prefill[C]`` whose token embeddings take those rows at the chunk's
  ``<|media_pad|>`` tokens (the chunk's first pad takes row ``first``, the next pad the next row).
  The engine prefills one request at a time, so the tower runs per request, once, before its first
  chunk (not batched across requests), and ``drop_media`` frees the rows after its last chunk.
- with a prefix cache (``prefix_block`` > 0): ``save_block`` / ``load_block`` copy one slot's MLA
  rows of one block out of / into the cache, ``save_state`` / ``load_state`` its KDA recurrent and
  conv state; saved pieces stay on device in ``self.store`` under an id the engine chooses (every
  process of a pod holds its shards of them), ``drop`` frees one.

Each program samples on device (per-row temperature / top-k / top-p, a banned token
(``sampling.pack_ban``: -1 none) and a key folded from the request's seed and its token count, so
a request's samples do not depend on its neighbours) and
returns token ids, their log-probabilities and the top ``TOP_LOGPROBS`` alternatives, replicated
on every device, so any process can read them.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.inference.lazy import Lazy
from k3jax.inference.media_programs import MediaPrograms
from k3jax.inference.prefix_programs import PrefixPrograms
from k3jax.inference.sampling import ban_left, logprobs, sample_rows_lp
from k3jax.sharding import refuse_stages, sharding_for

TOP_LOGPROBS = 20   # OpenAI's upper bound for chat top_logprobs (completions allow 5)
MIN_BUCKET = 32
MAX_STOP = 8          # stop ids a decode program takes (generate's EOS and end-of-message; -1 pads)


def prefill_buckets(chunk: int) -> list[int]:
    """Compiled prefill chunk lengths: powers of two from MIN_BUCKET below ``chunk``, and ``chunk``."""
    out, c = [], MIN_BUCKET
    while c < chunk:
        out.append(c)
        c *= 2
    return out + [chunk]


def row_buckets(rows: int, slots: int) -> list[int]:
    """Compiled batched-prefill row counts: powers of two from 2 below min(rows, slots), and it
    ([] when that is 1: every prompt prefills alone)."""
    top, out, b = min(rows, slots), [], 2
    while b < top:
        out.append(b)
        b *= 2
    return out + [top] if top > 1 else []


def decode_buckets(slots: int, given=None) -> list[int]:
    """Compiled decode batch sizes: ``given`` (``serve_decode_buckets``, validated by the config),
    else the powers of two below ``slots``, and ``slots``."""
    if given:
        return sorted(int(b) for b in given)
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return out + [slots]


def _is_spec_leaf(x) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], tuple)


def _keys(seeds, counters):
    """One PRNG key per row: the request's seed folded with its number of sampled tokens."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)


class Programs(MediaPrograms, PrefixPrograms):
    """The slot cache and the compiled decode / prefill / reset programs of one model.

    ``model`` holds the (sharded) weights; ``slots`` = B, ``length`` = S (cache positions per slot).
    Calls take numpy inputs (the same values on every process) and return numpy outputs.

    The parameters are an argument of every program, never baked in: ``update_weights`` puts new
    ones (e.g. from a training step, in another sharding) in place without recompiling, and bumps
    ``weight_version``. Each program compiles the first time a call needs it (``compile_s`` sums
    the seconds), or all at once with ``warm()`` (the server, so no request waits on a compile).
    """

    def __init__(self, model, mesh, *, slots: int, length: int, chunk: int, decode_sizes=None, prefix_block: int = 0,
                 media=None, prefill_rows: int = 1, decode_steps: int = 1, compile_fn=None,
                 top_logprobs: int = TOP_LOGPROBS):
        """``media``: (ProcessorConfig, ``<|media_pad|>`` id) of a vision model; None = text only.
        ``prefill_rows``: most prompts one prefill step takes (``serve_prefill_batch``).
        ``top_logprobs``: alternatives each step returns (0: none, and no top-k over the vocabulary
        in the step; ``generate``, which reports none).
        ``compile_fn(lowered) -> compiled``: how a program compiles (default ``lowered.compile()``);
        with it, ``model`` may be abstract (``jax.ShapeDtypeStruct`` leaves with shardings, e.g. a
        TPU topology's mesh from a CPU host: ``k3jax.compile``), and then no cache is allocated and
        only the programs can be used, not the calls."""
        self.mesh, self.slots, self.length = mesh, slots, length
        self.buckets = prefill_buckets(chunk)
        self.row_sizes = row_buckets(prefill_rows, slots)
        self.steps = decode_steps           # tokens per decode_steps call
        self.top_logprobs = top_logprobs
        self.decode_sizes = decode_buckets(slots, decode_sizes)
        # A block as long as the context could never be reused (a hit leaves >= 1 token to prefill).
        self.prefix_block = prefix_block if 0 < prefix_block < length else 0
        self.gdef, params, rest = nnx.split(model, nnx.Param, ...)
        self.state = (params, rest)
        self.weight_version = 0
        self.compile_s = 0.0
        refuse_stages(mesh)
        spec = model.cache_spec(slots, length)
        leaves, self._tdef = jax.tree.flatten(spec, is_leaf=_is_spec_leaf)
        self._batch_axis = [axes.index("batch") for _, _, axes in leaves]
        # KDA leaves hold state that an idle row must keep; MLA leaves ("c", "k_r") are only
        # written at the row's own slot, which an idle row points past the end.
        paths = jax.tree_util.tree_flatten_with_path(spec, is_leaf=_is_spec_leaf)[0]
        self._recurrent = [str(getattr(p[-1], "key", "")) not in ("c", "k_r") for p, _ in paths]
        for (_, _, axes), ax, rec in zip(leaves, self._batch_axis, self._recurrent):
            if not rec and axes[ax + 1:ax + 2] != ("cache_seq",):
                raise ValueError(f"an MLA cache leaf with axes {axes}: expected cache_seq right after batch")
        self.cache_shardings = [sharding_for(mesh, shape, axes) for shape, _, axes in leaves]
        self._cache_avals = [jax.ShapeDtypeStruct(shape, dt, sharding=s)
                             for (shape, dt, _), s in zip(leaves, self.cache_shardings)]
        self.replicated = NamedSharding(mesh, P())
        self._zeros = jax.jit(lambda: [jnp.zeros(s, d) for s, d, _ in leaves], out_shardings=self.cache_shardings)
        abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(self.state))
        self.cache = None if abstract else self._zeros()
        self._compile_fn = compile_fn or (lambda lowered: lowered.compile())
        self._multi = jax.process_count() > 1
        self.store: dict[int, list] = {}     # prefix cache pieces on device, by the caller's ids
        self.dirty: set[int] = set()          # slots a Generator wrote since it last reset them
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        self._decode = Lazy(lambda n: self._compile(self._decode_fn, self._decode_args(n)))
        self._prefill = Lazy(lambda c: self._compile(self._prefill_fn, self._prefill_args(c)))
        self._prefill_rows = Lazy(lambda r: self._compile(self._prefill_rows_fn, self._prefill_rows_args(r)))
        c = self.buckets[-1]
        self._one = Lazy(lambda name: {
            "reset": lambda: self._compile(self._reset_fn, [i32], out="cache"),
            "copy": lambda: self._compile(self._copy_fn, [i32, i32], out="cache"),
            "prefill_lp": lambda: self._compile(self._prefill_lp_fn, self._prefill_args(c)
                                                + [jax.ShapeDtypeStruct((c,), jnp.int32)]),
            **self._prefix_builders(leaves, i32)}[name]())
        self.media: dict[int, jax.Array] = {}   # projected image rows on device, by the caller's ids
        self.pcfg, self.media_pad = media if media is not None else (None, None)
        if media is not None:
            self._init_media(model)

    def warm(self) -> float:
        """Compile every program a server may call (each bucket) -> the seconds it took."""
        t = self.compile_s
        for n in self.decode_sizes:
            self._decode[n]
        for c in self.buckets:
            self._prefill[c]
        for r in self.row_sizes:
            self._prefill_rows[r]
        for name in ("reset", "copy", "prefill_lp") + (("save_block", "save_state", "load_block", "load_state")
                                                       if self.prefix_block else ()):
            self._one[name]
        if self.pcfg is not None:
            self._warm_media()
        return self.compile_s - t

    def program(self, kind: str, key=None):
        """The compiled program ``kind`` ("decode", "prefill", "prefill_rows" with its bucket as
        ``key``; "reset", "copy", "prefill_lp" and the prefix moves without), compiling it if
        needed (``k3jax.compile`` reads their memory and cost)."""
        if kind in ("decode", "prefill", "prefill_rows"):
            return {"decode": self._decode, "prefill": self._prefill, "prefill_rows": self._prefill_rows}[kind][key]
        return self._one[kind]

    def update_weights(self, params, rest=None) -> int:
        """Run every later call with ``params`` (an ``nnx.State`` of the model's ``nnx.Param``
        leaves, as ``nnx.split(model, nnx.Param, ...)`` gives them) and, if given, ``rest`` (the
        other state: router biases...). A leaf already in the programs' sharding is used as it is
        (no copy); one in another layout (a training step's fsdp sharding) is moved with
        ``jax.device_put``, one of another dtype cast first. Nothing recompiles: the parameters
        are an argument of every program. -> the new ``weight_version``."""
        new = [self._conform("params", params, self.state[0])]
        new.append(self.state[1] if rest is None else self._conform("rest", rest, self.state[1]))
        self.state = tuple(new)
        self.weight_version += 1
        return self.weight_version

    @staticmethod
    def _conform(what, new, old):
        got, want = jax.tree_util.tree_flatten_with_path(new)[0], jax.tree_util.tree_flatten_with_path(old)[0]
        if [p for p, _ in got] != [p for p, _ in want]:
            missing = {jax.tree_util.keystr(p) for p, _ in want} - {jax.tree_util.keystr(p) for p, _ in got}
            extra = {jax.tree_util.keystr(p) for p, _ in got} - {jax.tree_util.keystr(p) for p, _ in want}
            raise ValueError(f"update_weights: {what} do not match the model's: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(extra)[:5]}")
        out = []
        for (path, x), (_, o) in zip(got, want):
            if tuple(x.shape) != tuple(o.shape):
                raise ValueError(f"update_weights: {what}{jax.tree_util.keystr(path)} has shape {tuple(x.shape)}, "
                                 f"the model's is {tuple(o.shape)}")
            if x.dtype != o.dtype:
                x = x.astype(o.dtype)
            if getattr(x, "sharding", None) != o.sharding:
                x = jax.device_put(x, o.sharding)
            out.append(x)
        return jax.tree.unflatten(jax.tree.structure(old), out)

    def _piece(self, shape, dtype, axes, ax, block: int = 0):
        """Abstract array of one slot's rows of a cache leaf (``block`` > 0: ``block`` positions)."""
        shape = list(shape)
        shape[ax] = 1
        if block:
            shape[ax + 1] = block
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding_for(self.mesh, shape, axes))

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

    def _gather(self, cache, idx):
        """The rows ``idx`` of every cache leaf (the cache itself when ``idx`` is every slot)."""
        if len(idx) == self.slots:
            return cache
        return [jnp.take(x, idx, axis=ax) for x, ax in zip(cache, self._batch_axis)]

    def _scatter(self, cache, idx, rows, write):
        """``rows`` (of slots ``idx``) back into the cache: the KDA leaves whole, the MLA leaves only
        at the positions ``write`` [N, K] (the K tokens just decoded; past the end for an idle row)."""
        if len(idx) == self.slots:
            return rows
        n, out = len(idx), []
        for x, v, ax, rec in zip(cache, rows, self._batch_axis, self._recurrent):
            lead = (slice(None),) * ax
            if rec:
                out.append(x.at[lead + (idx,)].set(v.astype(x.dtype)))
            else:
                tok = v[lead + (jnp.arange(n)[:, None], jnp.minimum(write, self.length - 1))]
                out.append(x.at[lead + (idx[:, None], write)].set(tok.astype(x.dtype), mode="drop"))
        return out

    def _sample(self, logits, seeds, counters, temperature, top_k, top_p, ban):
        """-> the step's outputs: (tokens, logprob, top ids, top logprobs, behaviour logprob)."""
        tok, blp = sample_rows_lp(logits, _keys(seeds, counters), temperature, top_k, top_p, ban)
        return (tok, *logprobs(logits, tok, self._k(logits)), blp)

    def _decode_rows(self, state, rows, tokens, pos, active, temperature, top_k, top_p, seeds, counters, ban):
        """One decode step on gathered rows -> ((tokens, logprob, top ids, top logprobs), new rows)."""
        n = tokens.shape[0]
        write = jnp.where(active, pos, self.length)                # idle rows write past the end
        tree = jax.tree.unflatten(self._tdef, rows)
        logits, new = self._model(state).decode_step(tokens, tree, write, jnp.zeros((n,), jnp.int32))
        new = self._rows(jax.tree.leaves(new), rows, active)
        out = self._sample(logits, seeds, counters, temperature, top_k, top_p, ban)
        return out, new

    def _decode_fn(self, state, cache, idx, tokens, pos, active, temperature, top_k, top_p, seeds, counters, ban,
                   steps, stop):
        """``steps`` (<= K) decode steps of the N slots ``idx`` (sorted; all B slots in order for the
        largest bucket): step j decodes the token step j - 1 sampled, at the next position, with the
        next key -> outputs [K, N, ...] (those past ``steps`` are zeros), the new cache. The rows are
        gathered once before the steps and scattered back once after them. A row that samples one of
        ``stop`` [MAX_STOP] (-1 = none) stops there: its later steps leave its cache as it was, so
        the slot holds exactly its tokens (the stop token itself not yet fed) and can be continued."""
        k = self.steps
        rows = self._gather(cache, idx)
        shapes = jax.eval_shape(lambda: self._decode_rows(state, rows, tokens, pos, active, temperature, top_k,
                                                          top_p, seeds, counters, ban)[0])
        outs = [jnp.zeros((k, *o.shape), o.dtype) for o in shapes]

        def step(j, carry):
            rows, tok, at, ctr, ban, live, taken, outs = carry
            out, rows = self._decode_rows(state, rows, tok, at, live, temperature, top_k, top_p, seeds, ctr, ban)
            outs = [jax.lax.dynamic_update_index_in_dim(b, o, j, 0) for b, o in zip(outs, out)]
            taken = taken + live
            live = live & ~jnp.isin(out[0], stop)
            return rows, out[0], at + 1, ctr + 1, ban_left(ban, out[0]), live, taken, outs

        carry = (rows, tokens, pos, counters, ban, active, jnp.zeros_like(pos), outs)
        rows, *_, taken, outs = jax.lax.fori_loop(0, steps, step, carry)
        j = jnp.arange(k)
        write = jnp.where(active[:, None] & (j < taken[:, None]), pos[:, None] + j, self.length)
        return outs, self._scatter(cache, idx, rows, write)

    def _prefill_fn(self, state, cache, slot, tokens, pos, length, temperature, top_k, top_p, seed, counter, ban):
        row = [jax.lax.dynamic_slice_in_dim(x, slot, 1, ax) for x, ax in zip(cache, self._batch_axis)]
        logits, new = self._model(state).extend(tokens[None], jax.tree.unflatten(self._tdef, row), pos[None],
                                                length[None])
        cache = [jax.lax.dynamic_update_slice_in_dim(x, r.astype(x.dtype), slot, ax)
                 for x, r, ax in zip(cache, jax.tree.leaves(new), self._batch_axis)]
        out = self._sample(logits, seed[None], counter[None], temperature[None], top_k[None], top_p[None], ban[None])
        return out, cache

    def _prefill_rows_fn(self, state, cache, idx, tokens, pos, length, active, temperature, top_k, top_p, seeds,
                         counters, ban):
        """``_prefill_fn`` for the R slots ``idx`` (distinct) at once: tokens [R, C]; rows not
        ``active`` (padding) keep every cache leaf as it was."""
        rows = [jnp.take(x, idx, axis=ax) for x, ax in zip(cache, self._batch_axis)]
        logits, new = self._model(state).extend(tokens, jax.tree.unflatten(self._tdef, rows), pos, length)
        cache_out = []
        for x, v, old, ax in zip(cache, jax.tree.leaves(new), rows, self._batch_axis):
            keep = active.reshape([-1 if a == ax else 1 for a in range(v.ndim)])
            cache_out.append(x.at[(slice(None),) * ax + (idx,)].set(jnp.where(keep, v.astype(x.dtype), old)))
        return self._sample(logits, seeds, counters, temperature, top_k, top_p, ban), cache_out

    def _reset_fn(self, state, cache, slot):
        del state
        return [jax.lax.dynamic_update_slice_in_dim(x, jnp.zeros_like(jax.lax.dynamic_slice_in_dim(x, 0, 1, ax)),
                                                    slot, ax) for x, ax in zip(cache, self._batch_axis)]

    def _prefill_lp_fn(self, state, cache, slot, tokens, pos, length, temperature, top_k, top_p, seed, counter, ban,
                       targets):
        """``_prefill_fn`` that also scores the prompt: position i's log-probability of ``targets[i]``
        (the prompt token after it) and its top alternatives, for every position of the chunk."""
        row = [jax.lax.dynamic_slice_in_dim(x, slot, 1, ax) for x, ax in zip(cache, self._batch_axis)]
        logits, new = self._model(state).extend(tokens[None], jax.tree.unflatten(self._tdef, row), pos[None],
                                                length[None], all_positions=True)
        logits = logits[0]
        cache = [jax.lax.dynamic_update_slice_in_dim(x, r.astype(x.dtype), slot, ax)
                 for x, r, ax in zip(cache, jax.tree.leaves(new), self._batch_axis)]
        last = jax.lax.dynamic_slice_in_dim(logits, length - 1, 1, 0)
        out = self._sample(last, seed[None], counter[None], temperature[None], top_k[None], top_p[None], ban[None])
        return (*out[:4], *logprobs(logits, targets, self._k(logits)), out[4]), cache

    def _copy_fn(self, state, cache, src, dst):
        del state
        return [jax.lax.dynamic_update_slice_in_dim(x, jax.lax.dynamic_slice_in_dim(x, src, 1, ax), dst, ax)
                for x, ax in zip(cache, self._batch_axis)]

    def _k(self, logits):
        return min(self.top_logprobs, logits.shape[-1])

    # -- compilation ----------------------------------------------------------------------------
    def _decode_args(self, n):
        i32, f32 = jnp.int32, jnp.float32
        return ([jax.ShapeDtypeStruct((n,), dt) for dt in (i32, i32, i32, jnp.bool_, f32, i32, f32, jnp.uint32, i32,
                                                           i32)]
                + [jax.ShapeDtypeStruct((), i32), jax.ShapeDtypeStruct((MAX_STOP,), i32)])

    def _prefill_rows_args(self, r):
        i32, f32, c = jnp.int32, jnp.float32, self.buckets[-1]
        return ([jax.ShapeDtypeStruct((r,), i32), jax.ShapeDtypeStruct((r, c), i32)]
                + [jax.ShapeDtypeStruct((r,), dt) for dt in (i32, i32, jnp.bool_, f32, i32, f32, jnp.uint32, i32, i32)])

    def _prefill_args(self, c):
        scalars = (jnp.int32, jnp.int32, jnp.int32, jnp.float32, jnp.int32, jnp.float32, jnp.uint32, jnp.int32,
                   jnp.int32)
        return ([jax.ShapeDtypeStruct((), scalars[0]), jax.ShapeDtypeStruct((c,), jnp.int32)]
                + [jax.ShapeDtypeStruct((), dt) for dt in scalars[1:]])

    def _compile(self, fn, host_args, dev_args=(), out="step"):
        """AOT-compile fn(state, cache, *host_args, *dev_args). ``out``: "step" (replicated host
        outputs, the new cache; the cache is donated), "cache" (the new cache, donated) or a list of
        shardings (arrays read from the cache, which is not donated)."""
        t0 = time.perf_counter()
        host = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.replicated) for a in host_args]
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)
        # Host outputs replicated (any process reads its own copy whole); the cache keeps its layout.
        if out == "step":
            jitted = jax.jit(fn, donate_argnums=1, out_shardings=(self.replicated, self.cache_shardings))
        elif out == "cache":
            jitted = jax.jit(fn, donate_argnums=1, out_shardings=self.cache_shardings)
        else:
            jitted = jax.jit(fn, out_shardings=out)
        with jax.set_mesh(self.mesh):
            compiled = self._compile_fn(jitted.lower(state, self._cache_avals, *host, *dev_args))
        self.compile_s += time.perf_counter() - t0
        return compiled

    # -- calls (numpy in, numpy out) ------------------------------------------------------------
    def _put(self, x):
        x = np.asarray(x)
        if self._multi:
            return jax.make_array_from_process_local_data(self.replicated, x)
        return jax.device_put(x, self.replicated)

    @staticmethod
    def _get(x):
        return np.asarray(x.addressable_data(0))   # replicated: this process's copy is the whole array

    def decode(self, tokens, pos, active, temperature, top_k, top_p, seeds, counters, ban):
        """One decode step for the active slots; every argument is [B]. Runs the smallest decode
        bucket that holds the active slots (padded with idle ones). -> (tokens, logprob, top ids,
        top logprobs, behaviour logprob) as numpy arrays over the B slots (rows of idle slots are
        meaningless)."""
        return tuple(o[0] for o in self._run_decode(1, tokens, pos, active, temperature, top_k, top_p, seeds,
                                                    counters, ban))

    def decode_steps(self, tokens, pos, active, temperature, top_k, top_p, seeds, counters, ban, steps=None,
                     stop=()):
        """``decode`` for ``steps`` (default and at most K = ``decode_steps``) steps in one program
        (the caller makes sure each active row has that many positions left) -> the same outputs
        with a leading [steps] axis. A row that samples a token of ``stop`` (at most ``MAX_STOP``
        ids) stops there: its outputs after it are meaningless and its cache holds the tokens up to
        the one before the stop token."""
        steps = self.steps if steps is None else steps
        if not 1 <= steps <= self.steps:
            raise ValueError(f"decode_steps: {steps} steps, the programs run 1 to {self.steps}")
        return self._run_decode(steps, tokens, pos, active, temperature, top_k, top_p, seeds, counters, ban, stop)

    def _run_decode(self, steps, tokens, pos, active, temperature, top_k, top_p, seeds, counters, ban, stop=()):
        if len(stop) > MAX_STOP:
            raise ValueError(f"{len(stop)} stop ids; the decode programs take at most {MAX_STOP}")
        active = np.asarray(active, bool)
        act = np.flatnonzero(active)
        n = next(b for b in self.decode_sizes if b >= len(act))
        idx = np.sort(np.concatenate([act, np.flatnonzero(~active)[:n - len(act)]])).astype(np.int32)
        args = [self._put(np.asarray(a)[idx]) for a in (tokens, pos, active, temperature, top_k, top_p, seeds,
                                                        counters, ban)]
        stops = np.full(MAX_STOP, -1, np.int32)
        stops[:len(stop)] = list(stop)
        out, self.cache = self._decode[n](self.state, self.cache, self._put(idx), *args,
                                          self._put(np.int32(steps)), self._put(stops))
        full = []
        for o in out:
            o = self._get(o)[:steps]
            f = np.zeros((steps, self.slots, *o.shape[2:]), o.dtype)
            f[:, idx] = o
            full.append(f)
        return tuple(full)

    def prefill(self, slot, tokens, pos, temperature, top_k, top_p, seed, counter, ban):
        """Prefill ``tokens`` (at most the largest bucket) into ``slot`` after its first ``pos``
        tokens -> the token sampled after the last one (and its log-probabilities), as for decode."""
        c, args = self._chunk_args(slot, tokens, pos, temperature, top_k, top_p, seed, counter, ban)
        out, self.cache = self._prefill[c](self.state, self.cache, *args)
        return tuple(self._get(o)[0] for o in out)

    def prefill_rows(self, slots, tokens, pos, temperature, top_k, top_p, seeds, counters, ban):
        """``prefill`` of one chunk for each of the given slots (at most the largest row bucket;
        ``tokens`` a list of chunks, the others [R]) in the smallest row bucket that holds them ->
        (tokens [R], logprobs [R], top ids [R, K], top logprobs [R, K]) in the slots' order."""
        n, c = len(slots), self.buckets[-1]
        r = next(b for b in self.row_sizes if b >= n)
        busy = {int(x) for x in slots}
        idle = [s for s in range(self.slots) if s not in busy][:r - n]
        idx = np.array([*slots, *idle], np.int32)
        padded = np.zeros((r, c), np.int32)
        length = np.ones(r, np.int32)
        for i, t in enumerate(tokens):
            padded[i, :len(t)], length[i] = t, len(t)

        def col(v, dt, fill=0):
            return np.concatenate([np.asarray(v, dt), np.full(r - n, fill, dt)])
        args = [idx, padded, col(pos, np.int32), length, np.arange(r) < n, col(temperature, np.float32),
                col(top_k, np.int32), col(top_p, np.float32, 1), col(seeds, np.uint32), col(counters, np.int32),
                col(ban, np.int32, -1)]
        out, self.cache = self._prefill_rows[r](self.state, self.cache, *map(self._put, args))
        return tuple(self._get(o)[:n] for o in out)

    def _chunk_args(self, slot, tokens, pos, temperature, top_k, top_p, seed, counter, ban, *extra):
        """-> (the chunk bucket holding ``tokens``, the prefill programs' device arguments: the
        tokens padded to it; ``extra`` int32 scalars after the common ones)."""
        n = len(tokens)
        c = next(b for b in self.buckets if b >= n)
        padded = np.zeros(c, np.int32)
        padded[:n] = tokens
        return c, [self._put(np.asarray(v, dt)) for v, dt in (
            (slot, np.int32), (padded, np.int32), (pos, np.int32), (n, np.int32), (temperature, np.float32),
            (top_k, np.int32), (top_p, np.float32), (seed, np.uint32), (counter, np.int32), (ban, np.int32),
            *((e, np.int32) for e in extra))]

    def prefill_lp(self, slot, tokens, pos, temperature, top_k, top_p, seed, counter, ban, targets):
        """``prefill`` in the largest chunk bucket that also returns, per token of the chunk, the
        log-probability of the next prompt token (``targets``) and the top ``TOP_LOGPROBS``
        alternatives: (token, logprob, top ids, top logprobs, [n] logprobs, [n, K] ids, [n, K])."""
        n, c = len(tokens), self.buckets[-1]
        padded, tgt = np.zeros(c, np.int32), np.zeros(c, np.int32)
        padded[:n], tgt[:len(targets)] = tokens, targets
        args = [self._put(np.asarray(v, dt)) for v, dt in (
            (slot, np.int32), (padded, np.int32), (pos, np.int32), (n, np.int32), (temperature, np.float32),
            (top_k, np.int32), (top_p, np.float32), (seed, np.uint32), (counter, np.int32), (ban, np.int32),
            (tgt, np.int32))]
        out, self.cache = self._one["prefill_lp"](self.state, self.cache, *args)
        out = [self._get(o) for o in out]
        return (*(o[0] for o in out[:4]), *(o[:n] for o in out[4:7]), out[7][0])

    def copy(self, src: int, dst: int):
        """Slot ``dst``'s rows of every cache leaf := slot ``src``'s (the copies of an n > 1 request)."""
        self.cache = self._one["copy"](self.state, self.cache, *self._ints(src, dst))

    def reset(self, slot: int):
        """Zero slot ``slot``'s rows of every cache leaf."""
        self.cache = self._one["reset"](self.state, self.cache, self._put(np.asarray(slot, np.int32)))

    def row(self, slot: int):
        """Slot ``slot``'s cache rows as numpy arrays (tests: a freed slot is all zeros)."""
        return [np.take(np.asarray(jax.device_get(x)), slot, axis=ax) for x, ax in zip(self.cache, self._batch_axis)]

    # -- the prefix cache's pieces (ids chosen by the engine, the same on every process) ---------
    def _ints(self, *xs):
        return [self._put(np.asarray(x, np.int32)) for x in xs]
