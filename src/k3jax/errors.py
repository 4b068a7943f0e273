"""The one base class of the mistakes a user can fix, and how a tool reports them.

Config, data, tokenizer, checkpoint, conversion and training errors subclass ``UserError``; their
message is one line naming the key, file or value at fault and what to do. ``guard`` prints such
an error as ``error: <message>`` and returns exit status 2; any other exception is a bug in k3jax
and keeps its traceback. This module imports only the standard library, so every module may use it
(``k3jax.cli.run_tool`` builds the config-driven entry points on ``guard``).
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

KEYS_HELP = ("Every key is listed with its default and a comment in configs/base.yml; "
             "`python -m k3jax.config configs/base.yml model_name=<name>` prints a resolved config.")


class UserError(Exception):
    """A problem the user can fix; the message is one actionable line."""


class UsageError(UserError):
    """A command line that does not parse (a missing or unknown option)."""


class ConfigError(UserError, ValueError):
    """A configuration problem the user can fix; the message is one actionable line. Defined here,
    below everything, so modules under the config (k3jax.remat) can raise it; k3jax.schema and
    k3jax.config re-export it."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes are UsageErrors, so ``guard`` reports them on one line and exits 2
    like every other user error (``--help`` still prints the usage and exits 0)."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message} (see --help)")


def guard(fn: Callable[[], int | None]) -> int:
    """Run ``fn`` with the user-error contract: UserError -> one line on stderr and exit 2,
    Ctrl-C -> one line and exit 130 (after the tool's own ``finally`` blocks ran, e.g. a
    checkpoint save finishing); other exceptions propagate with their traceback."""
    try:
        return fn() or 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help", "help") for a in argv)


def usage(tool: str, doc: str | None) -> str:
    """The tool's usage text: its module docstring and where the keys are documented."""
    head = (doc or "").strip() or f"python -m k3jax.{tool} configs/base.yml key=value ..."
    return f"{head}\n\n{KEYS_HELP}"
