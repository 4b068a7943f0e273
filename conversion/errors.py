"""The one exception type raised by k3jax checkpoint conversion.

Conversion reads files written by other tools (Hugging Face shards, compressed-tensors quantized
experts, block-FP8 DeepSeek-style weights). When something in them is wrong or unsupported the
user needs to know *which file or tensor* and *what was expected versus found*, so every raise
site builds its message with that information instead of letting a numpy/JSON/OSError escape
from deep inside a helper.
"""
from k3jax.errors import UserError


class ConversionError(UserError):
    """A checkpoint cannot be read, decoded or written as asked.

    The message always names the offending file or tensor and states the expected value next
    to the one found (for example a truncated shard: its path, the bytes its header declares
    and the bytes on disk).
    """
