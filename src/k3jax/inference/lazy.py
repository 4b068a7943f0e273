"""Compiled programs keyed by bucket (a batch size, a chunk length, a name), each compiled the
first time a call asks for it: a one-off ``generate`` compiles only the shapes it runs, and a
server compiles them all at start (``Programs.warm``)."""
from __future__ import annotations


class Lazy(dict):
    """``Lazy(build)[key]`` is ``build(key)``, computed once."""

    def __init__(self, build):
        super().__init__()
        self._build = build

    def __missing__(self, key):
        self[key] = prog = self._build(key)
        return prog
