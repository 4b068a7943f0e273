"""Where the tiny K3's bf16 error comes from, part by part (issue 53, item 00).

The same weights run twice: a float32 network (dtype=float32) and a bfloat16 one (dtype=bfloat16,
weight_dtype=bfloat16; the leaves the model keeps in f32 stay f32). The f32 network gets the bf16
network's weights rounded to bf16 and back, so every difference below comes from bf16 activations and
arithmetic, not from rounding the weights. For each decoder layer three forwards run in lockstep:

  ref    the f32 network on the f32 run's residual state
  acc    the bf16 network on the bf16 run's own residual state (the error accumulated up to here)
  local  the bf16 network on the f32 run's residual state rounded to bf16 (the layer's own error)

and each part's intermediates are compared with ref's. Parts (worst layer for acc and local):

  router     sigmoid scores [N,E] (relative RMS) and the top-k choice: the fraction of tokens whose
             chosen expert set differs from ref's
  attn_res   the depth-softmax weights over the blocks (max |dp|), and the mixed input (rel. RMS)
  kda        the decay gate g, the write strength beta, the final recurrent state, the core output
  mla        the softmax probabilities (max |dp|), the per-head max logit (QK-clip's input), output
  logits     [B,T,V] relative RMS and top-1 agreement; loss = |mean CE (bf16) - mean CE (f32)|

Weights: ``--train-steps N`` trains the tiny K3 (the tests' TINY_TRAIN settings) for N steps with
``python -m k3jax.train`` and measures its checkpoint; ``--random`` also measures the random weights
of tests/test_gpu_check.py (std 0.3, every leaf perturbed: far from any trained model, the issue's
10.5% figure). Both run on the CPU:

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bf16_parts.py --train-steps 300 --random

Results: stdout tables and benchmarks/results/bf16_parts.json (--out to change).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_only, machine, print_table, result_path, write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# The tests' tiny trained checkpoint settings (tests/helpers.py TINY_TRAIN).
TINY_TRAIN = ["model_name=tiny", "vocab_size=512", "per_device_batch_size=2", "max_target_length=32",
              "log_period=50", "enable_tensorboard=false", "async_checkpointing=false", "peak_tflops=0.1"]


def train_tiny(out: Path, steps: int) -> Path:
    """Train the tiny K3 for ``steps`` steps in f32 -> its last checkpoint directory."""
    # One CPU device and single-threaded Eigen, as the tests' tool subprocesses (tests/helpers.py).
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS="--xla_cpu_multi_thread_eigen=false")
    subprocess.run([sys.executable, "-m", "k3jax.train", "configs/base.yml", *TINY_TRAIN,
                    f"base_output_directory={out}", "run_name=r", f"steps={steps}",
                    f"checkpoint_period={steps}"], cwd=REPO, env=env, check=True)
    return out / "r" / "checkpoints" / str(steps)


# -- the measurement --------------------------------------------------------------------------------

def _rel(a, b):
    import jax.numpy as jnp
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return jnp.sqrt(jnp.mean((a - b) ** 2)) / jnp.maximum(jnp.sqrt(jnp.mean(b ** 2)), 1e-30)


def _maxabs(a, b):
    import jax.numpy as jnp
    return jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32)))


def paired(cfg_f32, state_f32):
    """(cfg, graphdef, state) for the f32 and the bf16 network of the same weights: the bf16
    network's leaves are ``state_f32`` cast to the dtypes a dtype=weight_dtype=bfloat16 build
    declares; the f32 network's are those cast back (bf16-rounded where the bf16 one is bf16)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from k3jax import model as M
    tr = dataclasses.replace(cfg_f32.train, dtype="bfloat16", weight_dtype="bfloat16")
    cfg16 = dataclasses.replace(cfg_f32, train=tr)
    g32, s32 = nnx.split(nnx.eval_shape(lambda: M.build(cfg_f32, 0)))
    g16, s16 = nnx.split(nnx.eval_shape(lambda: M.build(cfg16, 0)))
    leaves, tdef = jax.tree.flatten(state_f32)
    want = jax.tree.leaves(s16)
    w16 = [jnp.asarray(x).astype(w.dtype) for x, w in zip(leaves, want)]
    w32 = [x.astype(jnp.asarray(y).dtype) for x, y in zip(w16, leaves)]
    return (cfg_f32, g32, jax.tree.unflatten(tdef, w32)), (cfg16, g16, jax.tree.unflatten(jax.tree.structure(s16), w16))


def _layer_at(model, l: int):
    """Decoder layer ``l`` as an unstacked module (a stacked period layer sliced at its index)."""
    import jax
    from flax import nnx
    path, i = model.layout.where(l)
    node = model
    for k in path:
        node = node[k] if isinstance(k, int) else getattr(node, k)
    if i is None:
        return node
    gdef, st = nnx.split(node)
    return nnx.merge(gdef, jax.tree.map(lambda x: x[i], st))


class _Probe:
    """Collects each part's intermediates of the forward now running under ``tag``."""

    def __init__(self, pin=()):
        self.rec, self.tag, self.mix_site, self.pin = {}, None, 0, set(pin)

    def pinned(self, part: str) -> bool:
        """Whether the acc run takes ``part``'s discrete-ish decision from ref (attribution runs)."""
        return self.tag == "acc" and part in self.pin

    def put(self, name, value):
        self.rec.setdefault(self.tag, {})[name] = value

    def install(self, layer, mixer: str, eps: float):
        import jax
        import jax.numpy as jnp

        from k3jax.layers.attn_res import depth_weights
        probe = self
        if layer.cfg.attn_res:
            mix = layer._mix

            def _mix(res, w, gamma):
                site = "pre" if probe.mix_site == 0 else "ffn"
                probe.mix_site += 1
                p = depth_weights(res["blocks"], res["n"], res["partial"], w[...], gamma[...], eps)
                probe.put(f"attn_res_{site}_p", p)
                if probe.pinned("depth"):       # ref's depth weights over this run's own sources
                    src = jnp.concatenate([res["blocks"], res["partial"][None]], 0).astype(jnp.float32)
                    p = probe.rec["ref"][f"attn_res_{site}_p"]
                    out = jnp.einsum("sbt,sbtd->btd", p, src).astype(res["partial"].dtype)
                else:
                    out = mix(res, w, gamma)
                probe.put(f"attn_res_{site}_out", out)
                return out
            layer._mix = _mix
        attn = layer.self_attn
        if mixer == "kda":
            core = attn.core

            def _core(q, k, v, g, beta, **kw):
                o, state = core(q, k, v, g, beta, **kw)
                probe.put("kda_g", g)
                probe.put("kda_beta", beta)
                probe.put("kda_state", state)
                probe.put("kda_o", o)
                return o, state
            attn.core = _core
        else:
            fn = attn.attention

            def _attention(q, k, v, segment_ids, *, scale):
                o, m = fn(q, k, v, segment_ids, scale=scale)
                # The probabilities every MLA path forms: softmax in f32 of the f32 logits of q, k.
                s = jnp.einsum("bthk,bshk->bhts", q, k, preferred_element_type=jnp.float32) * scale
                t = q.shape[1]
                mask = (jnp.arange(t)[None, :] <= jnp.arange(t)[:, None])[None, None]
                probe.put("mla_p", jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1))
                probe.put("mla_max_logit", m)
                probe.put("mla_o", o)
                return o, m
            attn.attention = _attention
        if layer.ffn == "moe":
            route = layer.mlp.route

            def _route(x):
                w, idx, scores = route(x)
                if probe.pinned("routing"):     # ref's experts and combine weights
                    w, idx = probe.rec["ref"]["router_w"], probe.rec["ref"]["router_idx"]
                probe.put("router_scores", scores)
                probe.put("router_idx", idx)
                probe.put("router_w", w)
                return w, idx, scores
            layer.mlp.route = _route


def _walk_fn(g32, g16, pin=()):
    """jit-able (state32, state16, tokens) -> per-layer probes of ref / acc / local and the logits."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    def run(s32, s16, tokens):
        m32, m16 = nnx.merge(g32, s32), nnx.merge(g16, s16)
        cfg = m32.cfg
        b, t = tokens.shape
        seg = jnp.ones((b, t), jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(t), (b, t))
        res = {"ref": m32._initial_residual(m32.embed(tokens)), "acc": m16._initial_residual(m16.embed(tokens))}
        layers = []
        for l in range(cfg.num_layers):
            probe = _Probe(pin)
            flags = {"first": l == 0, "block_start": m32._block_start(l)}
            outs = {}
            for tag, model, src in (("ref", m32, "ref"), ("acc", m16, "acc"), ("local", m16, "ref")):
                layer = _layer_at(model, l)
                probe.install(layer, cfg.mixer(l), cfg.rms_norm_eps)
                probe.tag, probe.mix_site = tag, 0
                r = res[src]
                if tag == "local":
                    r = jax.tree.map(lambda x: x.astype(m16.compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                                     else x, r)
                outs[tag], _, _ = layer(r, seg, pos, compute_aux=False, **flags)
            res = {"ref": outs["ref"], "acc": outs["acc"]}
            layers.append(probe.rec)

        def head(model, r):
            h = model.final_hidden(r)
            return jnp.einsum("btd,dv->btv", h, model.head_weight().astype(h.dtype), preferred_element_type=jnp.float32)

        cast = jax.tree.map(lambda x: x.astype(m16.compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                            res["ref"])
        logits = {"ref": head(m32, res["ref"]), "acc": head(m16, res["acc"]), "local": head(m16, cast)}
        return layers, logits

    return jax.jit(run)


def _ce(logits, tokens):
    import jax
    import jax.numpy as jnp
    lg, tg = logits[:, :-1], tokens[:, 1:]
    return jnp.mean(jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, tg[..., None], -1)[..., 0])


def summarize(layers, logits, tokens) -> dict:
    """Per-part worst-layer errors of acc and local against ref (floats), and the logits row."""
    import numpy as np
    metrics = {
        "router_scores": _rel, "router_w": _rel,
        "router_flip": lambda a, b: np.mean(np.any(np.sort(np.asarray(a), -1) != np.sort(np.asarray(b), -1), -1)),
        "attn_res_p": _maxabs, "attn_res_out": _rel,
        "kda_g": _rel, "kda_beta": _rel, "kda_state": _rel, "kda_o": _rel,
        "mla_p": _maxabs, "mla_max_logit": _rel, "mla_o": _rel,
    }
    # Probe keys each metric reads (both AttnRes sites of a layer for the AttnRes rows).
    src = {"router_flip": ("router_idx",), "attn_res_p": ("attn_res_pre_p", "attn_res_ffn_p"),
           "attn_res_out": ("attn_res_pre_out", "attn_res_ffn_out")}
    out = {}
    for tag in ("acc", "local"):
        row = {}
        for name, fn in metrics.items():
            vals = [float(fn(rec[tag][k], rec["ref"][k])) for rec in layers for k in src.get(name, (name,))
                    if k in rec["ref"]]
            row[name] = max(vals) if vals else None
        ref = np.asarray(logits["ref"], np.float64)
        got = np.asarray(logits[tag], np.float64)
        row["logits"] = float(np.sqrt(np.mean((got - ref) ** 2)) / np.sqrt(np.mean(ref ** 2)))
        row["top1_agree"] = float(np.mean(np.argmax(got, -1) == np.argmax(ref, -1)))
        row["loss_abs"] = float(abs(_ce(logits[tag], tokens) - _ce(logits["ref"], tokens)))
        out[tag] = row
    out["loss_f32"] = float(_ce(logits["ref"], tokens))
    # The dtype each part computes in inside the bf16 network (f32 where the references keep f32).
    out["bf16_run_dtypes"] = {k: str(v.dtype) for rec in layers for k, v in rec["acc"].items()}
    out["bf16_run_dtypes"]["logits"] = str(logits["acc"].dtype)
    return out


def measure(cfg, state_f32, tokens, pin=()) -> dict:
    """The per-part table of one f32 weight set (a model state tree of ``cfg``'s f32 build).
    ``pin``: parts whose decisions the bf16 run takes from the f32 run ("routing": the experts and
    combine weights; "depth": the AttnRes depth-softmax weights), to see how much they contribute."""
    (_, g32, s32), (_, g16, s16) = paired(cfg, state_f32)
    layers, logits = _walk_fn(g32, g16, tuple(pin))(s32, s16, tokens)
    return summarize(layers, logits, tokens)


def randomize_state(state, seed=0, scale=0.3):
    """tests/helpers.py ``randomize``: every leaf random and O(1)-sensitive (matrices N(0, scale^2),
    vectors perturbed by it, AttnRes queries and router biases included)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    rng = np.random.default_rng(seed)
    leaves, tdef = jax.tree.flatten(state)
    new = [(np.asarray(x, np.float32) + scale * rng.standard_normal(x.shape) if x.ndim < 2
            else scale * rng.standard_normal(x.shape)).astype(x.dtype) for x in leaves]
    return jax.tree.unflatten(tdef, [jnp.asarray(x) for x in new])


def load_cases(args):
    """[(name, cfg, f32 state)] for the weight sets asked for."""
    import jax
    from flax import nnx

    from k3jax import config as C
    from k3jax import model as M
    from k3jax import sharding as S
    from k3jax.state import restore_model
    cases = []
    base = TINY_TRAIN + ["dtype=float32", "weight_dtype=float32"]
    for steps in args.train_steps:
        ckpt = Path(args.work) / f"steps{steps}" / "r" / "checkpoints" / str(steps)
        if not ckpt.exists():
            train_tiny(Path(args.work) / f"steps{steps}", steps)
        cfg = C.load(C.REPO_CONFIGS / "base.yml", base + [f"load_parameters_path={ckpt}"])
        model = restore_model(cfg, S.make_mesh(cfg, jax.devices()[:1]))
        cases.append((f"trained {steps} steps", cfg, nnx.state(model)))
    if args.random:
        cfg = C.load(C.REPO_CONFIGS / "base.yml", base)
        cases.append(("random (std 0.3)", cfg, randomize_state(nnx.state(M.build(cfg, 0)))))
    return cases


COLUMNS = [("weights", "weights", "s"), ("run", "run", "s"), ("router scores", "router_scores", ".1e"),
           ("top-k flips", "router_flip", ".3f"), ("AttnRes |dp|", "attn_res_p", ".1e"),
           ("AttnRes out", "attn_res_out", ".1e"), ("KDA g", "kda_g", ".1e"), ("KDA beta", "kda_beta", ".1e"),
           ("KDA state", "kda_state", ".1e"), ("KDA out", "kda_o", ".1e"), ("MLA |dp|", "mla_p", ".1e"),
           ("MLA max logit", "mla_max_logit", ".1e"), ("MLA out", "mla_o", ".1e"), ("logits", "logits", ".2e"),
           ("top-1 agree", "top1_agree", ".3f"), ("|d loss|", "loss_abs", ".1e")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train-steps", type=int, nargs="*", default=[300], help="train the tiny K3 this many steps")
    p.add_argument("--random", action="store_true", help="also the random weights of tests/test_gpu_check.py")
    p.add_argument("--pin", nargs="*", default=["routing", "depth", "routing+depth"],
                   help="attribution runs: the bf16 run takes these parts' decisions from the f32 run")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=32)
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "k3jax-bf16-parts"))
    p.add_argument("--out", default=result_path("bf16_parts"))
    args = p.parse_args(argv)
    cpu_only()
    import jax.numpy as jnp
    import numpy as np
    rows = []
    for name, cfg, state in load_cases(args):
        tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.model.vocab_size, (args.batch, args.length)))
        m = measure(cfg, state, tokens)
        for tag in ("acc", "local"):
            rows.append({"weights": name, "run": tag, **m[tag], "loss_f32": m["loss_f32"]})
        for pin in args.pin:
            m = measure(cfg, state, tokens, pin.split("+"))
            rows.append({"weights": name, "run": f"acc, {pin} pinned", **m["acc"], "loss_f32": m["loss_f32"]})
    print("bf16 vs f32, same weights: worst layer per part (acc: bf16 run end to end; local: the bf16 layer on "
          "the f32 run's input)")
    print_table(rows, COLUMNS)
    command = " ".join(["benchmarks/bf16_parts.py", *(argv or sys.argv[1:])])
    write_json(args.out, {"machine": machine(), "command": command, "batch": args.batch, "length": args.length, "rows": rows})


if __name__ == "__main__":
    main()
