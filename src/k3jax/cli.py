"""The one runner of the config-driven command-line tools.

    python -m k3jax.<tool> configs/base.yml [model_name=...] key=value ...

``run_tool`` turns argv into a Config (``--help`` / ``-h`` print the tool's usage instead), prepares
the process (``runtime.prepare``: multi-host initialisation before anything touches a device) and
calls the tool, under ``errors.guard``: a ``UserError`` prints ``error: <one line>`` and exits 2,
Ctrl-C prints one line and exits 130, anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import sys
from typing import Callable

import jax

from k3jax import config as C
from k3jax.errors import guard, usage, wants_help
from k3jax.runtime import prepare


def run_tool(tool: str, body: Callable, argv: list[str] | None, doc: str | None = None, *,
             local_devices: bool = False) -> int:
    """Entry point of ``python -m k3jax.<tool>``: ``body(cfg)`` returns the exit status (None = 0).
    ``local_devices``: the tool runs on this process's devices (train, decode, serve, logit_check,
    unlike compile and plan), so the config is also checked against them (mesh sizes, a TPU-only
    kernel on another platform) before the tool reads a file or builds a model."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if wants_help(argv):
        print(usage(tool, doc))
        return 0

    def go():
        cfg = C.load_from_argv(argv)
        prepare(cfg)
        if local_devices:
            devices = jax.devices()
            C.validate(cfg, num_devices=len(devices), platform=devices[0].platform)
        return body(cfg)

    return guard(go)
