"""Input side of k3jax: Kimi tokenizer, chat template, SFT rendering and grain pipelines, the
image processor and the host half of media in the text model (media.py, media_layout.py), and the
training batches of a config (iterator.py); and the chat format read back from generated ids:
reply_text.py (detokenisation with stop strings), toolcalls.py (K2-family tool calls and thinking),
k3_toolcalls.py (K3's XTML replies), shared by the server and RL's rewards.

Python / numpy / grain on the host; jax is asked for the host's process index when the caller does
not pass one, and turns packed media into device arrays (``media.MediaInputs.arrays``); the device
half of media is k3jax.vision.splice. See docs/data.md.
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
