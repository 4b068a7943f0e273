"""Pipeline parallelism over the ``stage`` mesh axis (k3jax.stages) against the unpipelined model.

One 21-layer tiny K3 (dense layer 0, prefix 0-3, four scanned periods of KDA, KDA, KDA, MLA, tail
MLA layer 20) with AttnRes blocks of 6 layers: blocks start at layers 6 and 18 (mid-period) and 12
(a period start), so a block opens on each stage and spans the stage boundary. The same randomised
weights run on fsdp=8 (the reference; data=2 x fsdp=4 for the train steps) and pipelined; f32,
dropless MoE.

Tolerances: the pipelined runs reduce in another order than fsdp=8 (per-stage FSDP groups of 4, rows
in microbatches), as fsdp=8 does against one device (tests/test_context_parallel_model.py measured
up to 5.1e-5 relative RMS per parameter there). The criterion is 1e-5 relative RMS over the whole
tree (hidden states, all gradients together, all parameters after a step), and 5e-5 for any one
leaf; a period run out of order, a stage handed the wrong microbatch or a block flag on the wrong
layer moves them by 1e-1 or more.

Compiles (the CI cost): the reference's and two pipelined gradient programs on the batch's 16 rows:
stage=2 x fsdp=4 with 4 microbatches (more than stages: the circular store) and the AttnRes block
cache, and stage=2 x expert=2 x fsdp=2 with expert parallelism inside the stages, the weights
gathered once (its all-gathers are compared with the first program's) and no block cache (its hops
with the first's), and stage=2 x context=2 x fsdp=2 with 2 microbatches. The NaN-bubble run reuses
a compiled program (the fill is an argument). With K3JAX_SLOW_TESTS=1 also: a 37-layer model at
stage=4 (its reference and its program, 211 s of the 2-core CI host), the context run against
context=2 x fsdp=4, and three train steps (two train-step programs, shared with
tests/test_pipeline_checkpoint.py's round trip through the persistent compilation cache).
"""
import dataclasses
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import randomize, rel

from k3jax import config as C
from k3jax.compile import abstract_cache, compile_decode
from k3jax import model as M
from k3jax import sharding as S
from k3jax import stages as ST
from k3jax.layers.common import REST
from k3jax.state import abstract_state, init_state

BASE = ["model_name=tiny", "num_layers=21", "mla_extra_layers=[20]", "attn_res_block_size=6", "max_target_length=16",
        "per_device_batch_size=1", "moe_gather_max_tokens=0", "remat_policy=none", "enable_checkpointing=false",
        "qk_clip_threshold=0.5", "router_bias_update_rate=0.01", "warmup_steps_fraction=0", "lr_schedule=constant"]
REF = ["ici_fsdp_parallelism=8"]
PIPE = ["ici_stage_parallelism=2", "ici_fsdp_parallelism=4"]
# The train-step layouts: stage=2 x fsdp=4 with 4 microbatches (more than stages: the circular store)
# and the same in-stage layout without stages. test_train_steps_equal_unpipelined and
# test_pipeline_checkpoint's round trip jit the same two train steps at per_device_batch_size=2, so
# the second of them to run reads both programs from the persistent compilation cache.
PIPE4 = PIPE + ["num_pipeline_microbatches=4"]
UNSTAGED = ["ici_data_parallelism=2", "ici_fsdp_parallelism=4"]
B, T = 16, 16      # the batch (2 rows per device)
TOTAL_TOL, LEAF_TOL = 1e-5, 5e-5
UPDATE_LEAF_TOL = 5e-4    # one leaf of a train step's update (test_train_steps_equal_unpipelined)


def load(*args):
    return C.load(C.REPO_CONFIGS / "base.yml", BASE + list(args))


def tree_rel(got, want) -> tuple[float, dict]:
    """(relative RMS over every leaf together, {leaf path: its own relative RMS})."""
    g = dict(jax.tree_util.tree_leaves_with_path(got))
    w = dict(jax.tree_util.tree_leaves_with_path(want))
    assert g.keys() == w.keys()
    num = sum(float(np.sum((np.asarray(g[k], np.float64) - np.asarray(w[k], np.float64)) ** 2)) for k in w)
    den = sum(float(np.sum(np.asarray(w[k], np.float64) ** 2)) for k in w)
    return math.sqrt(num / den), {jax.tree_util.keystr(k): rel(g[k], w[k]) for k in w}


def assert_tree_close(got, want, what, total_tol=TOTAL_TOL, leaf_tol=LEAF_TOL):
    total, leaves = tree_rel(got, want)
    worst = max(leaves, key=leaves.get)
    assert total <= total_tol and leaves[worst] <= leaf_tol, \
        f"{what}: relative RMS {total:.2e} over all, worst leaf {worst} {leaves[worst]:.2e}"


def canonical(tree, stages):
    """A layout-or-model tree with its periods back in layer order (memory index s*R + r holds
    period r*S + s: ``stages.stage_major``, inverted here on its own)."""
    if stages == 1:
        return tree
    return dict(tree, periods=jax.tree.map(lambda x: x[np.argsort(ST.stage_major(x.shape[0], stages))], tree["periods"]))


def make_weights(*args, seed=1, rows=B):
    """The randomised model of ``load(*args)`` (periods in layer order) every run starts from, a batch
    of ``rows`` rows and a cotangent."""
    model = randomize(M.build(load(*args), 0), seed=seed)
    rng = np.random.default_rng(seed - 1)
    tokens = rng.integers(0, model.cfg.vocab_size, (rows, T + 1)).astype(np.int32)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((rows, T), np.int32),
             "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (rows, T)).copy(),
             "loss_mask": np.ones((rows, T), np.float32)}
    batch["segment_ids"][1, 9:] = 2                     # a packed second document in one row
    batch["positions"][1, 9:] -= 9
    cot = rng.standard_normal((rows, T, model.cfg.hidden_size)).astype(np.float32)
    return model, batch, cot


@pytest.fixture(scope="module")
def weights():
    return make_weights(*REF)


def placed(cfg, canon_model, *, optimizer=False):
    """(mesh, graphdef, state, tx) of ``cfg`` holding the weights of ``canon_model`` (periods put
    stage-major when pipelined) in ``cfg``'s shardings."""
    mesh = S.make_mesh(cfg)
    gdef, state, tx = init_state(cfg, mesh, optimizer=optimizer)
    stages = mesh.shape.get("stage", 1)
    src = nnx.clone(canon_model)
    if stages > 1:
        nnx.update(src.periods, jax.tree.map(lambda x: x[ST.stage_major(x.shape[0], stages)],
                                             jax.device_get(nnx.state(src.periods))))
    m = nnx.merge(gdef, state["params"], state["rest"])
    nnx.update(m, jax.device_put(nnx.state(src), jax.tree.map(lambda x: x.sharding, nnx.state(m))))
    _, state["params"], state["rest"] = nnx.split(m, nnx.Param, REST)
    if optimizer:
        from k3jax.optim.muon import init_sharded
        with jax.set_mesh(mesh):
            state["opt_state"] = init_sharded(tx, state["params"])
    # (XLA:CPU: two programs with collectives in flight at once can stall each other's rendezvous)
    return mesh, gdef, jax.block_until_ready(state), tx


def grads_program(gdef, pipe):
    """jit((params, rest, batch, cot, fill) -> (hidden, aux, grads)): sum(hidden * cot) differentiated,
    the periods run by ``pipe`` (``stages.pipeline_of``; None: the scan) with its buffers filled with
    ``fill`` before data reaches them."""
    def f(params, rest, batch, cot, fill):
        periods = None if pipe is None else dataclasses.replace(pipe, fill=fill)

        def loss(params):
            m = nnx.merge(gdef, params, rest)
            h, aux, _ = m.hidden(batch["tokens"], batch["segment_ids"], batch["positions"], compute_aux=True,
                                 periods=periods)
            return jnp.sum(h * cot), (h, aux)
        (_, (h, aux)), g = jax.value_and_grad(loss, has_aux=True)(params)
        return h, aux, g
    return jax.jit(f)


def run_grads(cfg, weights, fills=(0.0,), rows=B):
    """-> (mesh, state, compiled program, [(hidden, aux, grads) in layer order, per fill]) on the
    first ``rows`` rows of the batch."""
    canon, batch, cot = weights
    batch, cot = {k: v[:rows] for k, v in batch.items()}, cot[:rows]
    mesh, gdef, state, _ = placed(cfg, canon)
    stages = mesh.shape.get("stage", 1)
    with jax.set_mesh(mesh):
        args = (state["params"], state["rest"], jax.device_put(batch, S.batch_sharding(mesh)),
                jax.device_put(cot, S.batch_sharding(mesh, 3)))
        compiled = grads_program(gdef, ST.pipeline_of(cfg)).lower(*args, 0.0).compile()
        outs = []
        for fill in fills:
            h, aux, g = jax.device_get(compiled(*args, jnp.float32(fill)))
            outs.append((h, canonical(aux, stages), canonical(nnx.to_pure_dict(g), stages)))
    return mesh, state, compiled, outs


@pytest.fixture(scope="module")
def reference(weights):
    return run_grads(load(*REF), weights)[3][0]


@pytest.fixture(scope="module")
def stage2(weights):
    """run_grads at stage=2 x fsdp=4, 4 microbatches, bubble fills 0 and NaN (one compiled program)."""
    return run_grads(load(*PIPE, "num_pipeline_microbatches=4", "per_device_batch_size=2"), weights,
                     fills=(0.0, np.nan))


_CALLS = re.compile(r"(?:body|condition|calls|to_apply|branch_computations)=\{?([%\w.\-, ]+)\}?")


def loop_all_gathers(hlo: str) -> tuple[list[str], list[str]]:
    """The output shapes (e.g. "f32[32,16]") of the all-gathers of a compiled HLO module: (those in a
    while loop's body or a computation it calls, transitively: executed every iteration; the rest)."""
    comps, cur = {}, None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            cur = (line.split()[1] if line.startswith("ENTRY") else line.split()[0]).lstrip("%")
            comps[cur] = []
        elif line.startswith("}"):
            cur = None
        elif cur is not None:
            comps[cur].append(line)
    bodies = {m.group(1) for ls in comps.values() for l in ls if " while(" in l
              for m in [re.search(r"body=%?([\w.\-]+)", l)] if m}
    seen, todo = set(), list(bodies)
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        todo += [n.strip().lstrip("%") for l in comps[c] for m in _CALLS.finditer(l) for n in m.group(1).split(",")]
    shapes = {c: [m.group(1) for l in ls for m in [re.search(r"= (\w+\[[\d,]*\])\S* all-gather(?:-start)?\(", l)] if m]
              for c, ls in comps.items()}
    return [x for c in seen for x in shapes[c]], [x for c in comps if c not in seen for x in shapes[c]]


def period_weight_shapes(model) -> set[str]:
    """HLO shape strings of one period's weights (the stacked leaves without their period axis)."""
    return {f"{x.dtype.name.replace('float', 'f').replace('int', 's')}[{','.join(map(str, x.shape[1:]))}]"
            for x in jax.tree.leaves(nnx.state(model.periods))}


def assert_gathered_once(per_microbatch, once, weight_shapes) -> tuple[list[str], list[str]]:
    """The per-microbatch program gathers period weights inside its loops; the gathered-once program
    none there, and at least as many before them (a stage's [R=2, ...] slab or single periods).
    -> the gathered-once program's (in-loop, outside) all-gather shapes."""
    per_mb_in, _ = loop_all_gathers(per_microbatch.as_text())
    once_in, once_out = loop_all_gathers(once.as_text())
    assert len([x for x in per_mb_in if x in weight_shapes]) >= 20, per_mb_in
    assert not [x for x in once_in if x in weight_shapes], once_in
    stacked = {re.sub(r"\[", "[2,", x, count=1) for x in weight_shapes}
    assert len([x for x in once_out if x in weight_shapes | stacked]) >= 20, once_out
    return once_in, once_out


def hop_sizes(compiled, mesh) -> list[int]:
    """Element counts of the pipeline's stage hand-offs in a compiled program: the operands of the
    ``ppermute`` collective-permutes (forward, and their transposes in the backward) whose every
    source and target sit on different stages (not the context-parallel exchanges in a stage)."""
    stage_of = {int(d.id): s for s in range(mesh.shape["stage"]) for d in mesh.devices[s].flat}
    sizes = []
    for dims, pairs in re.findall(r"^\s*%ppermute[.\d]* = \w+\[([\d,]*)\].*source_target_pairs=\{(.*?)\}\}",
                                  compiled.as_text(), re.M):
        ends = [tuple(map(int, p.strip("{}").split(","))) for p in pairs.split("},{")]
        if all(stage_of[a] != stage_of[b] for a, b in ends):
            sizes.append(math.prod(int(d) for d in dims.split(",") if d))
    return sizes


def test_config_errors_and_aliases(capsys):
    with pytest.raises(C.ConfigError, match="stage parallelism 3 .* does not divide the 4 scanned layer periods"):
        load("ici_stage_parallelism=3")
    with pytest.raises(C.ConfigError, match="num_pipeline_microbatches=3 is not a multiple of the 2 pipeline stages"):
        load(*PIPE, "num_pipeline_microbatches=3")
    with pytest.raises(C.ConfigError, match="with tensor parallelism is not supported yet"):
        load("ici_stage_parallelism=2", "ici_tensor_parallelism=2")
    with pytest.raises(C.ConfigError, match="vision tower"):
        C.load(C.REPO_CONFIGS / "base.yml", BASE + PIPE + ["vision_enabled=true"])
    C.load(C.REPO_CONFIGS / "base.yml", [x for x in BASE if "checkpointing" not in x] + PIPE)   # saved in layer order
    cfg = load(*PIPE, "num_pipeline_microbatches=4")
    with pytest.raises(C.ConfigError, match="a batch of 8 rows does not split into 4 microbatches"):
        C.validate(cfg, num_devices=8)        # 2 rows per microbatch over 4 fsdp shards
    C.validate(load(*PIPE), num_devices=8)
    model = nnx.eval_shape(lambda: M.build(load(*PIPE), nnx.Rngs(0)))
    with pytest.raises(C.ConfigError, match="decode and serve run without pipeline stages"):
        abstract_cache(model, S.make_mesh(load(*PIPE)), 1, 16)
    capsys.readouterr()
    cfg = load("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4")
    assert cfg.mesh.ici_stage_parallelism == 2
    assert "'ici_pipeline_parallelism' is MaxText's name for 'ici_stage_parallelism'" in capsys.readouterr().err


def test_refusals_are_one_line():
    """Each refusal the pipeline makes is one ConfigError line naming the problem and what to do:
    the config checks, and decode and serve (the server's programs build a decode cache) at stage 2."""
    from k3jax.inference.programs import Programs
    cases = [(lambda: load("ici_stage_parallelism=3"), "does not divide the 4 scanned layer periods"),
             (lambda: load(*PIPE, "num_pipeline_microbatches=5"), "not a multiple of the 2 pipeline stages"),
             (lambda: C.validate(load(*PIPE, "num_pipeline_microbatches=4"), num_devices=8),
              "does not split into 4 microbatches"),
             (lambda: load(*PIPE, "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2"), "tensor parallelism"),
             (lambda: load(*PIPE, "vision_enabled=true"), "vision tower")]
    model = nnx.eval_shape(lambda: M.build(load(*PIPE), nnx.Rngs(0)))
    mesh = S.make_mesh(load(*PIPE))
    cases += [(lambda: abstract_cache(model, mesh, 2, 16), "decode and serve run without pipeline stages"),
              (lambda: compile_decode(load(*PIPE), mesh), "decode and serve"),
              (lambda: Programs(model, mesh, slots=2, length=16, chunk=8), "decode and serve")]
    for make, match in cases:
        with pytest.raises(C.ConfigError, match=match) as e:
            make()
        assert "\n" not in str(e.value), str(e.value)


def test_stage_axis_holds_half_the_period_weights():
    """Proof of a pipeline (1/2): at stage=2 each device holds half the scanned periods' bytes of the
    same in-stage layout without stages (data=2 x fsdp=4), and the unrolled layers' bytes are equal."""
    mesh_p, mesh_d = S.make_mesh(load(*PIPE)), S.make_mesh(load("ici_data_parallelism=2", "ici_fsdp_parallelism=4"))
    assert mesh_p.axis_names == ("stage",) + S.MESH_AXES and mesh_p.shape["stage"] == 2
    assert S.make_mesh(load(*REF)).axis_names == S.MESH_AXES          # no stage axis at stage 1

    def device_bytes(cfg, mesh, group):
        _, abstract, _ = abstract_state(cfg, mesh)
        leaves = jax.tree.leaves(abstract["params"][group])
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)

    assert device_bytes(load(*PIPE), mesh_p, "periods") * 2 == device_bytes(load("ici_data_parallelism=2", "ici_fsdp_parallelism=4"), mesh_d, "periods")
    assert device_bytes(load(*PIPE), mesh_p, "prefix") == device_bytes(load("ici_data_parallelism=2", "ici_fsdp_parallelism=4"), mesh_d, "prefix")


def test_stage2_fsdp4_equals_fsdp8(weights, reference, stage2):
    """Hidden states, MLA max logits, expert loads and every gradient at stage=2 x fsdp=4 with 4
    microbatches (stage 0 takes the last stage's hand-back of the first two from the circular
    store for their second repeat) equal fsdp=8; bubble inputs filled with NaN change nothing
    (same compiled program); the program permutes activations between the two stages' device
    groups, each hop the partial sum and one block (the block cache)."""
    mesh, _, compiled, (zero, nan) = stage2
    h0, aux0, g0 = reference
    for name, (h, aux, g) in (("fill 0", zero), ("fill NaN", nan)):
        assert rel(h, h0) <= TOTAL_TOL, (name, rel(h, h0))
        assert_tree_close(g, g0, f"gradients ({name})")
        assert_tree_close(aux, aux0, f"max logits / loads ({name})")
    for a, b in zip(jax.tree.leaves((zero[0], zero[2])), jax.tree.leaves((nan[0], nan[2]))):
        np.testing.assert_array_equal(a, b)
    hlo = compiled.as_text()
    groups = [[int(d.id) for d in mesh.devices[s].flat] for s in range(2)]
    pairs = {f"{{{a},{b}}}" for a, b in zip(groups[0], groups[1])} | {f"{{{b},{a}}}" for a, b in zip(*groups)}
    permutes = [l for l in hlo.splitlines() if "collective-permute" in l and "source_target_pairs" in l]
    assert any(all(p in l for p in pairs) for l in permutes), "no collective-permute between the stages"
    # The block cache (default): a hop carries the partial sum and the one block the next stage has
    # not seen ([1 row, T, D] each per device), not the buffer of 4 blocks (the run without it below)
    shard = B // 4 // 4 * T * zero[0].shape[-1]         # a microbatch's rows over fsdp=4
    assert hop_sizes(compiled, mesh) == [shard] * 4, hop_sizes(compiled, mesh)


def test_stage2_expert2_fsdp2_gather_once_equals_fsdp8(weights, reference, stage2):
    """The expert-parallel MoE shard_map nested inside the pipeline's shard_map over stage, with
    ``pipeline_fsdp_ag_once``, and without the block cache (``pipeline_attn_res_cache=false``): hidden
    states, max logits, loads and every gradient equal fsdp=8, as with it (stage=2 x fsdp=4).
    Gathered once, no all-gather of a period weight is left inside the compiled program's loops
    (they run before the schedule), where the per-microbatch program (stage=2 x fsdp=4) has them."""
    cfg = load("ici_stage_parallelism=2", "ici_expert_parallelism=2", "ici_fsdp_parallelism=2",
               "per_device_batch_size=2", "pipeline_fsdp_ag_once=true", "pipeline_attn_res_cache=false")
    C.validate(cfg, num_devices=8)
    mesh, _, compiled, ((h, aux, g),) = run_grads(cfg, weights)
    h0, aux0, g0 = reference
    assert rel(h, h0) <= TOTAL_TOL, rel(h, h0)
    assert_tree_close(g, g0, "gradients")
    assert_tree_close(aux, aux0, "max logits / loads")
    # Without the block cache a hop carries the whole buffer [NB=4, mb, T, D] beside the partial sum
    shard = B // 2 // 4 * T * h.shape[-1]                # a microbatch's rows over expert x fsdp = 4
    nb = len(weights[0].cfg.attn_res_block_starts)
    assert sorted(hop_sizes(compiled, mesh)) == [shard] * 2 + [nb * shard] * 2, hop_sizes(compiled, mesh)

    once_in, once_out = assert_gathered_once(stage2[2], compiled, period_weight_shapes(weights[0]))
    # Outside the pipeline (prefix layers 0-3, tail layer 20) the rows are split over stage too: the
    # MoE dispatch and KDA shard_maps name it, so no all-gather brings every token of the batch
    # (B x T = 256) to a device at the hidden or latent width (before, 7 of each: the MoE weight
    # gradients read the whole batch; K3 at dcn_stage=2 asked for 112 GiB buffers of them).
    m = weights[0].cfg
    whole = {f"f32[{B * T},{m.hidden_size}]", f"f32[{B * T},{m.moe_latent_size}]"}
    assert not [x for x in once_in + once_out if x in whole], sorted(set(once_in + once_out) & whole)


def test_stage2_context2_fsdp2_equals_fsdp8(weights, reference):
    """Context parallelism inside the stages: each stage's sequences split over context=2 (the KDA
    state and MLA keys passed between the halves, the MoE dispatch a shard_map over the stage's row
    shards), 2 microbatches. Hidden states, max logits, loads and every gradient equal fsdp=8 to the
    spread context parallelism has without stages (context=2 x fsdp=4 against fsdp=8, this model and
    batch: 3.2e-5 relative RMS over all gradients, 1.0e-4 its worst leaf, host C, 2026-12-07); with
    K3JAX_SLOW_TESTS=1 also context=2 x fsdp=4 itself, to this file's 1e-5 / 5e-5 (measured 4.1e-6 and
    2.8e-5). A hop carries a microbatch's rows split over fsdp and its positions over context."""
    cfg = load("ici_stage_parallelism=2", "ici_context_parallelism=2", "ici_fsdp_parallelism=2",
               "num_pipeline_microbatches=2", "per_device_batch_size=2")
    C.validate(cfg, num_devices=8)
    mesh, _, compiled, ((h, aux, g),) = run_grads(cfg, weights)
    refs = [("fsdp=8", reference, 1e-4, 3e-4)]
    if os.environ.get("K3JAX_SLOW_TESTS"):     # one more gradient program (~200 s of worker time, issue 49)
        unstaged = run_grads(load("ici_context_parallelism=2", "ici_fsdp_parallelism=4"), weights)[3][0]
        refs.append(("context=2 x fsdp=4", unstaged, TOTAL_TOL, LEAF_TOL))
    for name, (h0, aux0, g0), total_tol, leaf_tol in refs:
        assert rel(h, h0) <= total_tol, (name, rel(h, h0))
        assert_tree_close(g, g0, f"gradients against {name}", total_tol, leaf_tol)
        assert_tree_close(aux, aux0, f"max logits / loads against {name}", total_tol, leaf_tol)
    shard = B // 2 // 2 * (T // 2) * h.shape[-1]        # [mb rows / fsdp, T / context, D]
    assert hop_sizes(compiled, mesh) == [shard] * 4, hop_sizes(compiled, mesh)


@pytest.mark.parametrize("impl,most_rows", [("tokamax", 0), ("vocab_parallel", B // 2)])
def test_losses_keep_rows_split_over_stage(impl, most_rows):
    """The loss runs outside the pipeline, where the rows are split over stage too: its shard_map
    kernels name stage among their row axes, so the gradient program of tokamax's loss all-gathers
    no hidden rows and vocab_parallel's only one stage's rows of its vocabulary group (without
    stage: [4, T, D] over stage for tokamax, the whole batch [16, T, D] for vocab_parallel)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from k3jax.step import make_loss
    cfg = load(*PIPE, "vocab_size=2048", f"loss_impl={impl}")     # tokamax's XLA loss: V a multiple of 2048
    mesh, loss, d = S.make_mesh(cfg), make_loss(cfg), cfg.model.hidden_size
    rows = NamedSharding(mesh, P(("stage", "data", "fsdp", "expert")))

    def grads(h, w, targets, mask):
        return jax.grad(lambda h, w: loss(h, w, targets, mask)[0], argnums=(0, 1))(h, w)
    with jax.set_mesh(mesh):
        args = (jax.ShapeDtypeStruct((B, T, d), jnp.float32, sharding=rows),
                jax.ShapeDtypeStruct((d, 2048), jnp.float32, sharding=NamedSharding(mesh, P())),
                jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=rows), jax.ShapeDtypeStruct((B, T), jnp.float32, sharding=rows))
        hlo = jax.jit(grads).lower(*args).compile().as_text()
    gathered = [int(m.group(1)) for m in re.finditer(rf"= f32\[(\d+),{T},{d}\]\S* all-gather(?:-start)?\(", hlo)]
    assert max(gathered, default=0) <= most_rows, (impl, gathered)


# A 37-layer model: prefix 0-3, eight periods (layers 4-35), tail MLA layer 36; AttnRes blocks of 10
# start at layers 10 (mid-period 1), 20 (period 4's first layer: stage 0 on its second repeat) and 30
# (mid-period 6), so the block of layers 10-19 spans stages 1, 2 and 3.
L37 = ["num_layers=37", "mla_extra_layers=[36]", "attn_res_block_size=10"]


@pytest.mark.skipif(not os.environ.get("K3JAX_SLOW_TESTS"), reason=(
    "211 s on the 2-core CI host (a 37-layer reference and stage=4 program); the CI runs stage=2 with "
    "the circular store and the gathered-once weights; run with K3JAX_SLOW_TESTS=1"))
def test_stage4_fsdp2_repeats_8_microbatches_gather_once_equal_fsdp8(weights, stage2):
    """stage=4 x fsdp=2 with 2 repeats (8 periods on 4 stages) and 8 microbatches (more than stages:
    stage 0 reads the last stage's hand-back from the circular store) on 48 rows, with
    ``pipeline_fsdp_ag_once``: hidden states, max logits, loads and every gradient equal fsdp=8.
    Gathered once, no all-gather of a period weight is left inside the compiled program's loops
    (they run before the schedule), where the per-microbatch program (stage=2 x fsdp=4) has them."""
    # 48 rows: a microbatch is 6 rows, 3 per fsdp shard, so its activations' token dimension (96 on a
    # shard's all-gathers) is no dimension of a weight and the all-gathers below tell the two apart.
    w = make_weights(*L37, *REF, seed=2, rows=48)
    pipe = load(*L37, "ici_stage_parallelism=4", "ici_fsdp_parallelism=2", "num_pipeline_microbatches=8",
                "per_device_batch_size=6", "pipeline_fsdp_ag_once=true")
    C.validate(pipe, num_devices=8)           # 8 microbatches of 6 rows over 2 fsdp shards
    assert ST.bubble_fraction(4, 8, 2) == 3 / 19
    _, _, _, ((h0, aux0, g0),) = run_grads(load(*L37, *REF), w, rows=48)
    _, _, compiled, ((h, aux, g),) = run_grads(pipe, w, rows=48)
    assert rel(h, h0) <= TOTAL_TOL, rel(h, h0)
    assert_tree_close(g, g0, "gradients")
    assert_tree_close(aux, aux0, "max logits / loads")

    weight_shapes = period_weight_shapes(w[0])
    assert weight_shapes == period_weight_shapes(weights[0])
    assert_gathered_once(stage2[2], compiled, weight_shapes)


@pytest.mark.skipif(not os.environ.get("K3JAX_SLOW_TESTS"), reason=(
    "two train-step compiles, 140-235 s on a 2-core host; run with K3JAX_SLOW_TESTS=1"))
def test_train_steps_equal_unpipelined(weights):
    """Three train steps (Muon, QK-clip clipping heads, the router-bias update) at stage=2 x fsdp=4
    with 4 microbatches (more than stages: the circular store) equal data=2 x fsdp=4, the same
    in-stage layout without stages. Each pipelined step starts from the unpipelined run's state
    before that step (parameters, router biases, optimizer state; moved to stage-major): its loss,
    gradient norm, max logit, expert load and clipped heads, its parameter and bias updates and the
    optimizer state it leaves are within 1e-5 relative RMS of the unpipelined step's (over all
    leaves; any one leaf of an update within 5e-4: AdamW divides each element of the vectors it
    updates by that element's own gradient magnitude, so an element whose gradient is near zero
    carries its relative rounding into the update; measured: updates 1.1e-6 to 6.1e-6 over all,
    worst leaf 1.9e-4, an AttnRes norm's first update; optimizer state 1.2e-7, worst leaf 1.1e-5;
    the router-bias updates equal; host C, 2026-12-07).

    Steps are compared one at a time because two runs left to themselves drift apart by more than
    that in f32 whatever their layouts: the rounding of one update grows through the next (from the
    same start, the second step's gradient norm is 1.3e-4 apart at stage=2 against data=2 x fsdp=4,
    and 5.7e-5 apart between two unpipelined layouts, fsdp=8 against data=2 x fsdp=4; host C,
    2026-12-06)."""
    from k3jax.state import layer_order, memory_order
    from k3jax.step import jit_train_step
    canon, batch, _ = weights
    runs = []
    for args in (UNSTAGED, PIPE4):
        cfg = load(*args, "per_device_batch_size=2")
        C.validate(cfg, num_devices=8)
        mesh, gdef, state, tx = placed(cfg, canon, optimizer=True)
        with jax.set_mesh(mesh):       # the train loop's program (state donated): the two programs
            runs.append((cfg, mesh, jit_train_step(cfg, gdef, tx, state),   # test_pipeline_checkpoint runs
                         jax.device_put(batch, S.batch_sharding(mesh)), state))
    (_, ref_mesh, ref_step, ref_batch, state), (cfg, mesh, step, pipe_batch, pipe_state) = runs
    shardings = jax.tree.map(lambda x: x.sharding, pipe_state)
    del pipe_state
    updates = lambda new, old: jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                                            nnx.to_pure_dict(new), nnx.to_pure_dict(old))
    clipped = 0
    for k in range(3):
        before = jax.device_get(state)
        with jax.set_mesh(mesh):
            got, m1 = step(memory_order(cfg, jax.device_put(before, shardings)), pipe_batch)
            got = jax.device_get(layer_order(cfg, got))
        with jax.set_mesh(ref_mesh):
            state, m0 = ref_step(state, ref_batch)
        want = jax.device_get(state)
        m0, m1 = jax.device_get((m0, m1))
        for key in ("loss", "grad_norm", "max_logit", "expert_load_max_over_mean"):
            assert abs(float(m1[key]) - float(m0[key])) <= TOTAL_TOL * abs(float(m0[key])), (k, key, m1[key], m0[key])
        assert int(m1["qk_clipped_heads"]) == int(m0["qk_clipped_heads"]), k
        clipped += int(m0["qk_clipped_heads"])
        for what, a, b, leaf_tol in (
                (f"step {k}: parameter update", updates(got["params"], before["params"]),
                 updates(want["params"], before["params"]), UPDATE_LEAF_TOL),
                (f"step {k}: router-bias update", updates(got["rest"], before["rest"]),
                 updates(want["rest"], before["rest"]), UPDATE_LEAF_TOL),
                (f"step {k}: optimizer state", got["opt_state"], want["opt_state"], LEAF_TOL)):
            assert_tree_close(a, b, what, leaf_tol=leaf_tol)
        assert any(np.any(u) for u in jax.tree.leaves(updates(want["rest"], before["rest"]))), k  # biases move
    assert clipped > 0                                   # QK-clip acts in these steps
