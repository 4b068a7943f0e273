"""Evaluation during training: held-out loss and token accuracy, and HellaSwag accuracy.

``eval_dataset_path`` is read like the training data (the same dataset_type, tokenizer, sft_format
and SFT fitting) but unshuffled and at most once, so every evaluation sees the same first
``eval_steps`` batches (all of them with -1) and two evaluations compare the same tokens.

* ``eval_loss`` / ``eval_accuracy``: masked next-token cross-entropy and argmax accuracy over every
  target token of those batches, token-weighted like the training loss (for SFT: the assistant's
  tokens only).
* HellaSwag (``dataset_type=sft sft_format=hellaswag``): each row's four endings are rendered as
  the assistant's answer to the row's question, one candidate per batch row; the model's choice is
  the ending with the lowest summed loss, and ``eval_hellaswag_accuracy`` is the fraction of rows
  whose choice is the label (chance: 0.25). ``eval_loss`` / ``eval_accuracy`` are then those of
  the correct endings. ``eval_steps`` counts batches of candidates; a row counts once all four of
  its endings were scored.

* Image conversations (``dataset_type=mm_sft``): the held-out conversations with their images,
  batched as for training (media grouped per row, one patch bucket agreed by every process), the
  loss on the answers only.

On a pod the processes evaluate in step: each of them reads its own data shard, and the shards may
hold different numbers of batches (records dropped as too long, bad records skipped), so before
each batch the processes tell each other whether they still have one. A process whose shard has
run out feeds its last batch again with every target masked (it adds nothing to any sum) until
the longest shard is done; without this, the process with more batches would wait forever in the
eval step's collectives for a process that had moved on. A shard with no batch at all is one
error on every process.

The eval step is its own jitted function (forward only, no remat), compiled once for the eval batch
shape (and, with images, once per patch bucket) on the training mesh against the training state's
shardings, so evaluating never recompiles the train step. It returns per-row sums, replicated, which
every process can read.
"""
from __future__ import annotations

import json
import logging
import time

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.config import ConfigError
from k3jax.console import timed_compile
from k3jax.data import mm_sft, sft
from k3jax.data import pipeline as P
from k3jax.data.iterator import bad_data_options, sft_options
from k3jax.data.sources import DataError, JsonlSource
from k3jax.data.vision_processor import from_config
from k3jax.feed import host_feed, token_sharding
from k3jax.loss import chunked_row_losses
from k3jax.stages import pipeline_of
from k3jax.vision.splice import slot_loss_mask

log = logging.getLogger(__name__)


def eval_rows(cfg, num_devices: int) -> int:
    """Global rows of an eval batch: eval_per_device_batch_size (0 = the training one) x devices /
    context, as the training batch (``Config.global_batch_size``)."""
    return cfg.global_batch_size(num_devices, cfg.eval.eval_per_device_batch_size or cfg.train.per_device_batch_size)


def make_eval_step(cfg, gdef):
    """(params, rest, batch) -> per-row (loss sum [B], target tokens [B], correct [B]), f32. A batch
    with ``"media"`` splices them in and takes no loss on targets that are media slots. With pipeline
    stages the forward runs through the training step's pipeline (``stages.pipeline_of``)."""
    periods = pipeline_of(cfg)

    def step(params, rest, batch):
        model = nnx.merge(gdef, params, rest)
        media = batch.get("media")
        h, _, _ = model.hidden(batch["tokens"], batch["segment_ids"], batch["positions"], media=media,
                               periods=periods)
        mask = batch["loss_mask"]
        if media is not None:
            mask = slot_loss_mask(mask, media["slots"])
        return chunked_row_losses(h, model.head_weight(), batch["targets"], mask, chunk=cfg.kernel.loss_chunk_size)
    return step


def candidate_row(tokens: np.ndarray, weights: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """One scored sequence as one batch row (the pipeline's batch contract, one segment, padded)."""
    n = len(tokens)
    row = {"tokens": np.zeros(seq_len, np.int32), "targets": np.zeros(seq_len, np.int32),
           "segment_ids": np.zeros(seq_len, np.int32), "positions": np.zeros(seq_len, np.int32),
           "loss_mask": np.zeros(seq_len, np.float32)}
    row["tokens"][:n] = tokens
    row["targets"][:n - 1] = tokens[1:]
    row["loss_mask"][:n - 1] = weights[1:]
    row["segment_ids"][:n] = 1
    row["positions"][:n] = np.arange(n)
    return row


def _filler_row(seq_len: int) -> dict[str, np.ndarray]:
    """A row that fills the last batch: one segment of token 0 (an all-padding row would leave
    attention with no key to attend to) and no target, so it adds nothing to any sum."""
    return {"tokens": np.zeros(seq_len, np.int32), "targets": np.zeros(seq_len, np.int32),
            "segment_ids": np.ones(seq_len, np.int32), "positions": np.arange(seq_len, dtype=np.int32),
            "loss_mask": np.zeros(seq_len, np.float32)}


def hellaswag_candidates(cfg, tokenizer) -> tuple[list[dict], np.ndarray, int]:
    """Every row's four endings as batch rows (row-major), the labels, and the number of rows
    skipped because a candidate is longer than max_target_length. Bad rows follow bad_data."""
    seq_len, system = cfg.train.max_target_length, sft_options(cfg)["sft_default_system"]
    src = JsonlSource(cfg.eval.eval_dataset_path)
    rows, labels, too_long = [], [], 0
    for i in range(len(src)):
        payload, where = src[i]
        if not payload.strip():
            continue
        try:
            cands, label = sft.hellaswag_candidates(tokenizer, json.loads(payload), default_system=system)
        except (ValueError, UnicodeDecodeError) as e:   # json.JSONDecodeError is a ValueError
            if cfg.data.bad_data == "fatal":
                raise DataError(f"{where}: {e}") from None
            log.warning("skipping bad HellaSwag row at %s: %s", where, e)
            continue
        if max(len(t) for t, _ in cands) > seq_len:
            too_long += 1
            continue
        rows += [candidate_row(t, w, seq_len) for t, w in cands]
        labels.append(label)
    if not labels:
        raise DataError(f"eval_dataset_path={cfg.eval.eval_dataset_path}: no HellaSwag row to evaluate "
                        f"({too_long} longer than max_target_length={seq_len})")
    return rows, np.asarray(labels), too_long


def check_eval_data(cfg, tokenizer) -> None:
    """Open the evaluation files and check their first records (``bad_data_check_records``) now,
    before a model is built, so a mistake in them costs seconds rather than a compile."""
    if cfg.data.dataset_type == "mm_sft":
        _mm_dataset(cfg, tokenizer, 1, 0, 1)
        return
    P.make_dataset(dataset_type=cfg.data.dataset_type, paths=cfg.eval.eval_dataset_path, tokenizer=tokenizer,
                   seq_len=cfg.train.max_target_length, batch_size=1, seed=cfg.data.data_seed, shuffle=False,
                   num_epochs=1, bad_data=cfg.data.bad_data, vocab_size=cfg.model.vocab_size,
                   text_key=cfg.data.text_key, process_index=0, process_count=1, **sft_options(cfg),
                   **bad_data_options(cfg))


def _mm_dataset(cfg, tokenizer, batch_size: int, shard: int, num_shards: int):
    """The held-out image conversations (``mm_sft.make_dataset``), unshuffled, one pass, their first
    records checked as the training data's."""
    opts = sft_options(cfg)
    return mm_sft.make_dataset(paths=cfg.eval.eval_dataset_path, tokenizer=tokenizer, vcfg=cfg.vision,
                               pcfg=from_config(cfg), seq_len=cfg.train.max_target_length, batch_size=batch_size,
                               seed=cfg.data.data_seed, shuffle=False, num_epochs=1, process_index=shard,
                               process_count=num_shards, bad_data=cfg.data.bad_data, image_root=cfg.data.image_root,
                               sft_overlong=opts["sft_overlong"], sft_default_system=opts["sft_default_system"],
                               **bad_data_options(cfg))[0]


class Evaluator:
    """Runs an evaluation every ``eval_interval`` steps and after the last one (see module doc)."""

    def __init__(self, cfg, mesh, gdef, tokenizer):
        self.cfg, self.mesh = cfg, mesh
        self.rows = eval_rows(cfg, mesh.devices.size)
        try:   # the eval batch is sharded like the training batch, fed by data shards the same way
            token_sharding(mesh).shard_shape((self.rows, cfg.train.max_target_length))
            self.feed = host_feed(mesh, self.rows, cfg.train.max_target_length)
        except (ValueError, ConfigError):
            raise ConfigError(f"the eval batch of {self.rows} rows does not split over the mesh's batch shards "
                              f"and {jax.process_count()} processes; change eval_per_device_batch_size") from None
        self.hellaswag = cfg.data.dataset_type == "sft" and cfg.data.sft_format == "hellaswag"
        self.fn = jax.jit(make_eval_step(cfg, gdef), out_shardings=NamedSharding(mesh, PartitionSpec()))
        self.compiled: dict = {}      # by the batch's media shapes (() for text)
        if self.hellaswag:
            self.candidates, self.labels, self.too_long = hellaswag_candidates(cfg, tokenizer)
        elif cfg.data.dataset_type == "mm_sft":
            self.dataset = _mm_dataset(cfg, tokenizer, self.feed.local_rows, self.feed.shard, self.feed.num_shards)
        else:
            self.dataset, _ = P.make_dataset(
                dataset_type=cfg.data.dataset_type, paths=cfg.eval.eval_dataset_path, tokenizer=tokenizer,
                seq_len=cfg.train.max_target_length, batch_size=self.feed.local_rows, seed=cfg.data.data_seed,
                shuffle=False, num_epochs=1, process_index=self.feed.shard, process_count=self.feed.num_shards, bad_data=cfg.data.bad_data, vocab_size=cfg.model.vocab_size,
                text_key=cfg.data.text_key, **sft_options(cfg), **bad_data_options(cfg))

    def due(self, step: int) -> bool:
        return step % self.cfg.eval.eval_interval == 0 or step == self.cfg.train.steps

    def _local_batches(self):
        """This process's share of each eval batch (numpy), at most eval_steps of them."""
        limit = self.cfg.eval.eval_steps
        if self.hellaswag:
            n = len(self.candidates)
            seq_len = self.cfg.train.max_target_length
            for i, start in enumerate(range(0, n, self.rows)):
                if 0 < limit <= i:
                    return
                rows = self.candidates[start:start + self.rows]
                rows = rows + [_filler_row(seq_len)] * (self.rows - len(rows))
                per = self.feed.local_rows
                mine = rows[self.feed.shard * per:(self.feed.shard + 1) * per]
                yield {k: np.stack([r[k] for r in mine]) for k in mine[0]}
            return
        for i, batch in enumerate(iter(self.dataset)):
            if 0 < limit <= i:
                return
            yield batch

    def _batches_in_step(self):
        """``_local_batches`` kept in step with the other processes (see the module docstring): as
        many batches as the process with the most, a finished process repeating its last batch with
        its loss mask zeroed."""
        mine, last = self._local_batches(), None
        while True:
            batch = next(mine, None)
            if jax.process_count() > 1:
                have = np.asarray(multihost_utils.process_allgather(np.int32(batch is not None))).reshape(-1)
                if not have.any():
                    return
                if last is None and not have.all():
                    empty = sorted({self.feed.shards[p][0] for p in np.flatnonzero(have == 0)})
                    raise DataError(f"eval_dataset_path={self.cfg.eval.eval_dataset_path} gives data shard(s) {empty} "
                                    f"of {self.feed.num_shards} no full eval batch of {self.feed.local_rows} rows "
                                    f"(shard k reads records k, k + {self.feed.num_shards}, ... of the evaluation files); "
                                    f"add data or lower eval_per_device_batch_size")
            elif batch is None:
                return
            if batch is None:
                batch = {**last, "loss_mask": np.zeros_like(last["loss_mask"])}
            else:
                last = batch
            yield batch

    def run(self, state) -> dict:
        """One evaluation of ``state``: the eval_* metrics of the step record."""
        t0 = time.perf_counter()
        loss, weight, correct = [], [], []
        for batch in self._batches_in_step():
            batch, _ = self.feed.agree_media(batch, self.cfg.vision.vision_merge_kernel_size)
            g = self.feed.put_batch(batch)
            args = (state["params"], state["rest"], g)
            key = tuple((k, v.shape) for k, v in sorted(g.get("media", {}).items()))
            if key not in self.compiled:
                what = f"eval step for {g['media']['patches'].shape[1]} image patches per row" if key else "eval step"
                with jax.set_mesh(self.mesh):
                    self.compiled[key] = timed_compile(what, self.fn, *args)
            out = jax.device_get(self.compiled[key](*args))
            loss.append(out[0])
            weight.append(out[1])
            correct.append(out[2])
        if not loss:
            raise DataError(f"eval_dataset_path={self.cfg.eval.eval_dataset_path} gives no full eval batch of "
                            f"{self.rows} rows; add data or lower eval_per_device_batch_size")
        loss, weight, correct = (np.concatenate(x) for x in (loss, weight, correct))
        rec = {}
        if self.hellaswag:
            q = min(len(loss), len(self.candidates)) // 4       # questions with all four endings scored
            scores = loss[:4 * q].reshape(q, 4)
            labels = self.labels[:q]
            pick = np.arange(q) * 4 + labels                      # the correct endings' rows
            loss, weight, correct = loss[pick], weight[pick], correct[pick]
            rec["eval_hellaswag_accuracy"] = float(np.mean(np.argmin(scores, -1) == labels))
            rec["eval_hellaswag_rows"] = q
        tokens = float(weight.sum())
        rec.update(eval_loss=float(loss.sum() / max(tokens, 1.0)), eval_accuracy=float(correct.sum() / max(tokens, 1.0)),
                   eval_tokens=tokens, eval_time_s=time.perf_counter() - t0)
        return rec
