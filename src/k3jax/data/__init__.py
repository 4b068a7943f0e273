"""Input side of k3jax: Kimi tokenizer, chat template, SFT rendering and grain pipelines.

Pure Python / numpy / grain; jax is only asked for the host's process index when the caller
does not pass one. See docs/data.md.
"""
from k3jax.data.chat_template import (DEFAULT_SYSTEM, read_chat_template, render,
                                      render_text, render_with_jinja)
from k3jax.data.pipeline import (PipelineIterator, PipelineStats, make_dataset, make_pipeline,
                                 pipeline_stats, split_document)
from k3jax.data.sft import (conversation_to_example, hellaswag_prompt, hellaswag_to_messages,
                            record_to_messages)
from k3jax.data.sources import (ArrayRecordSource, DataError, JsonlSource, ParquetSource,
                                SyntheticSource)
from k3jax.data.tokenizer import PAT_STR, KimiTokenizer, TokenizerError

__all__ = [
    "DEFAULT_SYSTEM", "PAT_STR", "ArrayRecordSource", "DataError", "JsonlSource",
    "KimiTokenizer", "ParquetSource", "PipelineIterator", "PipelineStats", "SyntheticSource",
    "TokenizerError", "conversation_to_example", "hellaswag_prompt", "hellaswag_to_messages",
    "make_dataset", "make_pipeline", "pipeline_stats", "read_chat_template", "record_to_messages",
    "render", "render_text", "render_with_jinja", "split_document",
]
