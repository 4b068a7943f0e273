"""The training batches of a config: one iterator factory for every ``dataset_type``, and the data
settings that training and evaluation read alike (``sft_options``, ``bad_data_options``).

``data_iterator`` hands text (``pretrain`` / ``sft`` / ``synthetic`` ...) to ``k3jax.data.pipeline``
and image conversations (``mm_sft``, batches with ``"media"``) to ``k3jax.data.mm_sft``; each yields
a checkpointable grain iterator over one data shard (``feed.host_feed`` picks the shard).
"""
from __future__ import annotations

import jax

from k3jax.data import mm_sft
from k3jax.data import pipeline as P
from k3jax.data.chat_template import DEFAULT_SYSTEM
from k3jax.data.vision_processor import from_config


def bad_data_options(cfg) -> dict:
    """The bad-data policy's limits (early check of the first records, largest bad fraction)."""
    return {"check_records_first": cfg.data.bad_data_check_records,
            "max_bad_fraction": cfg.data.bad_data_max_fraction}


def sft_options(cfg) -> dict:
    """The SFT settings of the data pipeline (training and evaluation read records alike)."""
    d = cfg.data
    return {"sft_format": d.sft_format, "sft_overlong": d.sft_overlong,
            "sft_default_system": DEFAULT_SYSTEM if d.sft_default_system_prompt else None}


def data_iterator(cfg, global_batch: int, tokenizer=None, *, shard: int | None = None,
                  num_shards: int | None = None) -> P.PipelineIterator:
    """Data shard ``shard`` of ``num_shards`` of the training batches (a checkpointable grain
    iterator of global_batch / num_shards rows each): the rows the processes of one shard feed
    (``feed.host_feed``: one shard per process unless a context group spans processes). Default:
    this process of all of them. ``dataset_type=mm_sft`` needs the tokenizer."""
    num_shards = jax.process_count() if num_shards is None else num_shards
    shard = jax.process_index() if shard is None else shard
    if cfg.data.dataset_type == "mm_sft":
        return _mm_sft_iterator(cfg, global_batch, tokenizer, shard=shard, num_shards=num_shards)
    return P.make_pipeline(dataset_type=cfg.data.dataset_type, paths=cfg.data.dataset_path, tokenizer=tokenizer,
                           process_index=shard, process_count=num_shards,
                           seq_len=cfg.train.max_target_length, batch_size=global_batch // num_shards,
                           seed=cfg.data.data_seed, shuffle=cfg.data.data_shuffle, bad_data=cfg.data.bad_data,
                           vocab_size=cfg.model.vocab_size, text_key=cfg.data.text_key,
                           num_epochs=cfg.data.num_epoch or None, **sft_options(cfg), **bad_data_options(cfg))


def _mm_sft_iterator(cfg, global_batch: int, tokenizer, *, shard: int, num_shards: int) -> P.PipelineIterator:
    """The training batches of ``dataset_type=mm_sft``: data shard ``shard`` of ``num_shards``,
    global_batch / num_shards rows each."""
    opts = sft_options(cfg)
    ds, stats = mm_sft.make_dataset(paths=cfg.data.dataset_path, tokenizer=tokenizer, vcfg=cfg.vision,
                                    pcfg=from_config(cfg), seq_len=cfg.train.max_target_length,
                                    batch_size=global_batch // num_shards, seed=cfg.data.data_seed,
                                    shuffle=cfg.data.data_shuffle, process_index=shard, process_count=num_shards,
                                    bad_data=cfg.data.bad_data, num_epochs=cfg.data.num_epoch or None,
                                    image_root=cfg.data.image_root, sft_overlong=opts["sft_overlong"],
                                    sft_default_system=opts["sft_default_system"], **bad_data_options(cfg))
    return P.PipelineIterator(iter(ds), stats, (shard, num_shards))
