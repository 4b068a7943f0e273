"""How the decoder layers are grouped for the scan, and the one walker over that grouping.

Layers are grouped as ``prefix`` (unrolled: the period holding the dense layer 0), ``periods`` (a
stack of ``num_periods`` identical super-blocks of one layer period, e.g. KDA, KDA, KDA, MLA, each
with an MoE FFN, run by ``lax.scan``) and ``tail`` (unrolled irregular layers, e.g. K3's final MLA
layer 92).

Every per-layer tree of the stack has that shape, a *layout tree*::

    {"prefix":  [entry per prefix layer],
     "periods": [entry per layer of one period, leaves stacked [num_periods, ...]] | None,
     "tail":    [entry per tail layer]}

The forward's side outputs (MLA max logits, MoE loads), the decode cache and its spec are layout
trees; the parameters follow the same grouping (``model.prefix[i]``, ``model.periods.layers[j]``,
``model.tail[i]``, see ``Site.module_path``). A ``Site`` names one entry; ``Layout.map`` and
``Layout.items`` visit every entry, stacked and unstacked alike, so no caller walks the three groups
by hand. Pure Python: imported by the model, the optimizer (QK-clip) and the converter alike.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

GROUPS = ("prefix", "periods", "tail")


@dataclasses.dataclass(frozen=True)
class Site:
    """One entry of a layout tree: a single layer, or one layer position of the scanned period
    (``stacked``: its leaves hold ``len(layers)`` copies along a leading axis, in layer order)."""
    group: str                 # "prefix" | "periods" | "tail"
    index: int                 # position within the group
    layers: tuple[int, ...]    # decoder layer number(s) of this entry

    @property
    def stacked(self) -> bool:
        return self.group == "periods"

    @property
    def layer(self) -> int:
        """The first layer of the entry; every layer of a stacked entry has the same kind."""
        return self.layers[0]

    @property
    def module_path(self) -> tuple:
        """Path of the entry's DecoderLayer in the model (and of its parameters in the state)."""
        return ("periods", "layers", self.index) if self.stacked else (self.group, self.index)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which layers are unrolled before the scan, scanned as periods, and unrolled after."""
    prefix: tuple[int, ...]
    period: int
    num_periods: int
    tail: tuple[int, ...]

    @property
    def scan_start(self) -> int:
        return len(self.prefix)

    def period_layers(self, i: int) -> list[int]:
        s = self.scan_start + i * self.period
        return list(range(s, s + self.period))

    def sites(self) -> list[Site]:
        """Every entry, in layer order of the first layer (prefix, period positions, tail)."""
        out = [Site("prefix", i, (l,)) for i, l in enumerate(self.prefix)]
        if self.num_periods:
            out += [Site("periods", j, tuple(self.scan_start + p * self.period + j for p in range(self.num_periods)))
                    for j in range(self.period)]
        out += [Site("tail", i, (l,)) for i, l in enumerate(self.tail)]
        return out

    def where(self, layer: int) -> tuple[tuple, int | None]:
        """(module path of the DecoderLayer holding decoder layer ``layer``, its index along the
        stacked axis or None), e.g. (("periods", "layers", 3), 1) or (("tail", 0), None)."""
        for s in self.sites():
            if layer in s.layers:
                return s.module_path, (s.layers.index(layer) if s.stacked else None)
        raise ValueError(f"layer {layer} is not in this layout")

    def map(self, fn: Callable[..., Any], *trees) -> dict:
        """A layout tree of ``fn(site, *entries)``, the entries taken from ``trees`` (layout trees;
        none for a tree built from the sites alone)."""
        out: dict = {"prefix": [], "periods": [] if self.num_periods else None, "tail": []}
        for s in self.sites():
            out[s.group].append(fn(s, *(t[s.group][s.index] for t in trees)))
        return out

    def items(self, tree) -> list[tuple[Site, Any]]:
        """[(site, entry)] of a layout tree, in ``sites()`` order."""
        return [(s, tree[s.group][s.index]) for s in self.sites()]


def period_kinds(cfg) -> list[tuple[str, str]]:
    """(mixer, ffn) of the layers of one scanned period: mla_every - 1 KDA layers, then MLA, all MoE."""
    return [("kda", "moe")] * (cfg.mla_every - 1) + [("mla", "moe")]


def layout(cfg, scan: bool = True) -> Layout:
    """Find the longest run of identical all-MoE periods after the dense layers (cfg: ModelConfig)."""
    p = cfg.mla_every
    if p == 0:
        return Layout(tuple(range(cfg.num_layers)), 1, 0, ())
    sched = cfg.schedule
    pattern = period_kinds(cfg)
    start = math.ceil(cfg.first_k_dense / p) * p
    n = 0
    while start + (n + 1) * p <= cfg.num_layers and sched[start + n * p:start + (n + 1) * p] == pattern:
        n += 1
    if not scan or n < 2:
        return Layout(tuple(range(cfg.num_layers)), p, 0, ())
    return Layout(tuple(range(start)), p, n, tuple(range(start + n * p, cfg.num_layers)))
