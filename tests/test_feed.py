"""What each process feeds of a batch (k3jax.feed) and how many rows a global batch has.

The host layouts are computed from the mesh alone, so one process can derive every process's
block: here the 8 fake CPU devices are split into 2 or 4 pretended hosts (``process_of``), in the
order a pod's processes own them (consecutive device ids)."""
import jax
import numpy as np
import pytest

from k3jax import config as C
from k3jax import sharding as S
from k3jax.feed import host_feed, token_sharding


def _cfg(*args):
    return C.load(C.REPO_CONFIGS / "base.yml", ["max_target_length=32", *args])


def _feeds(mesh, rows, hosts):
    return [host_feed(mesh, rows, 32, p, process_of=lambda d: d.id * hosts // 8) for p in range(hosts)]


@pytest.mark.parametrize("args, rows, want", [
    # no context axis: every host its own shard of the rows, whole sequences
    (["ici_fsdp_parallelism=8"], 16, [(0, 2, (0, 8), (0, 32)), (1, 2, (8, 16), (0, 32))]),
    # the context axis spans the hosts: one shard (both read the same rows), each host a sequence half
    (["ici_fsdp_parallelism=1", "ici_context_parallelism=2", "ici_expert_parallelism=4"], 8,
     [(0, 1, (0, 8), (0, 16)), (0, 1, (0, 8), (16, 32))]),
    # the context axis inside each host: every host its own rows, whole sequences
    (["ici_fsdp_parallelism=2", "ici_context_parallelism=4"], 4, [(0, 2, (0, 2), (0, 32)), (1, 2, (2, 4), (0, 32))]),
], ids=["fsdp8", "context-across-hosts", "context-inside-hosts"])
def test_two_hosts_feed_their_rows_and_sequence_slices(args, rows, want):
    cfg = _cfg(*args)
    mesh = S.make_mesh(cfg)
    assert cfg.global_batch_size(8) == rows
    feeds = _feeds(mesh, rows, 2)
    assert [(f.shard, f.num_shards, *f.row_ranges, *f.seq_ranges) for f in feeds] == want
    assert feeds[0].shards == feeds[1].shards == tuple((s, n) for s, n, *_ in want)
    # every device's block of the global batch is inside its host's block, at the place
    # make_array_from_process_local_data maps it to
    g = np.arange(rows * 32).reshape(rows, 32)
    index = token_sharding(mesh).devices_indices_map((rows, 32))
    for p, f in enumerate(feeds):
        (r0, r1), = f.row_ranges
        local = f.local({"tokens": g[r0:r1]})["tokens"]          # the shard pipeline's rows, sliced
        assert local.shape == (f.local_rows, f.local_length) == (r1 - r0, f.seq_ranges[0][1] - f.seq_ranges[0][0])
        np.testing.assert_array_equal(local, g[r0:r1, f.seq_ranges[0][0]:f.seq_ranges[0][1]])
        for d, (rs, ss) in index.items():
            if d.id * 2 // 8 == p:
                assert r0 <= (rs.start or 0) and (rs.stop or rows) <= r1
                assert f.seq_ranges[0][0] <= (ss.start or 0) and (ss.stop or 32) <= f.seq_ranges[0][1]


def test_four_hosts_two_context_groups():
    """context=2 x expert=4 over 4 hosts: hosts 0, 2 share rows 0..4 (shard 0), hosts 1, 3 rows
    4..8 (shard 1); hosts 0, 1 feed positions 0..16, hosts 2, 3 positions 16..32."""
    mesh = S.make_mesh(_cfg("ici_fsdp_parallelism=1", "ici_context_parallelism=2", "ici_expert_parallelism=4"))
    feeds = _feeds(mesh, 8, 4)
    assert [(f.shard, f.num_shards, f.row_ranges, f.seq_ranges) for f in feeds] == [
        (0, 2, ((0, 4),), ((0, 16),)), (1, 2, ((4, 8),), ((0, 16),)),
        (0, 2, ((0, 4),), ((16, 32),)), (1, 2, ((4, 8),), ((16, 32),))]
    assert "feeding data shard 1 of 2: rows 4..8 of 8, positions 16..32 of 32" == feeds[3].describe()


def test_one_process_puts_the_global_batch():
    """The single-process path: this process feeds everything; the array is the batch, sharded
    rows over the batch axes and positions over context."""
    mesh = S.make_mesh(_cfg("ici_fsdp_parallelism=2", "ici_context_parallelism=4"))
    f = host_feed(mesh, 4, 32)
    assert (f.shard, f.num_shards, f.local_rows, f.local_length) == (0, 1, 4, 32)
    b = {"tokens": np.arange(128, dtype=np.int32).reshape(4, 32), "loss_mask": np.ones((4, 32), np.float32)}
    out = f.put(b)
    np.testing.assert_array_equal(jax.device_get(out["tokens"]), b["tokens"])
    assert out["tokens"].sharding.is_equivalent_to(token_sharding(mesh), 2)
    assert out["tokens"].addressable_shards[0].data.shape == (2, 8)
    with pytest.raises(ValueError, match=r"expected this data shard's \(4, 32"):
        f.local({"tokens": b["tokens"][:, :16]})


def test_a_batch_that_does_not_split_is_a_config_error():
    mesh = S.make_mesh(_cfg("ici_fsdp_parallelism=8"))
    with pytest.raises(C.ConfigError, match="does not split over the mesh"):
        host_feed(mesh, 4, 32)


@pytest.mark.parametrize("args, devices, rows", [
    ([], 8, 16),                                                                     # fsdp fills: 2 x 8
    (["ici_fsdp_parallelism=2", "ici_context_parallelism=4"], 8, 4),                 # 2 x 8 / 4
    (["ici_fsdp_parallelism=2", "ici_context_parallelism=-1"], 8, 4),                # context fills to 4
    (["ici_context_parallelism=2", "dcn_context_parallelism=2", "ici_fsdp_parallelism=2"], 8, 4),  # 2 x 2 context
    (["ici_context_parallelism=4", "ici_fsdp_parallelism=2", "per_device_batch_size=0.5"], 8, 1),  # 0.5 x 8 / 4
])
def test_global_batch_counts_rows_of_context_groups(args, devices, rows):
    """The global batch is rows: per_device_batch_size x devices / context (a context group of
    devices holds slices of the same rows); evaluation batches count the same way."""
    cfg = _cfg(*args)
    assert cfg.global_batch_size(devices) == rows
    from k3jax.evaluate import eval_rows
    assert eval_rows(C.override(cfg, {"eval_per_device_batch_size": 2 * cfg.train.per_device_batch_size}),
                     devices) == 2 * rows


def test_data_state_is_restored_only_into_its_own_shard(tmp_path):
    """A data-iterator state names its shard: a restart whose mesh gives this process another
    shard (a context axis that now spans hosts, or no longer does) repositions the data instead of
    continuing another shard's records; states saved before they named a shard still restore."""
    from k3jax.checkpoint import Checkpointer
    from k3jax.data.pipeline import make_pipeline

    def pipe(shard, n):
        return make_pipeline(dataset_type="synthetic", paths=None, tokenizer=None, seq_len=16, batch_size=2, seed=0,
                             vocab_size=64, process_index=shard, process_count=n)
    a = pipe(0, 2)
    next(a)
    state = a.get_state()
    assert state["data_shard"] == [0, 2]
    with pytest.raises(ValueError, match=r"state is of data shard \(0, 2\), this pipeline reads shard \(0, 1\)"):
        pipe(0, 1).set_state(state)
    b, old = pipe(0, 2), pipe(0, 2)
    b.set_state(state)
    old.set_state(state["pipeline"])                 # the format before shards were named
    want = next(a)
    for it in (b, old):
        np.testing.assert_array_equal(next(it)["tokens"], want["tokens"])

    ck = Checkpointer(tmp_path / "ck", async_save=False)
    x = {"w": jax.numpy.ones(4)}
    ck.save(1, x, x, x, pipe(0, 1), force=True)
    ck.wait()
    assert ck.saved_data_shards(1) == [(0, 1)]
    abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding), x)
    assert ck.restore(1, abstract, abstract, abstract, pipe(0, 1))[3] is True
    assert ck.restore(1, abstract, abstract, abstract, pipe(1, 2))[3] is False    # another shard: repositioned
    ck.close()
