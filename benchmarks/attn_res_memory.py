"""Compiled backward memory of the AttnRes block buffer: flat scan vs segment scan, side by side.

A model with K3's layer layout (93 layers: KDA, KDA, KDA, MLA periods, the last layer MLA, AttnRes
blocks of 12) at small widths, one row of T tokens, f32, remat=full: forward + gradient of the
final hidden states wrt every parameter, compiled on the CPU (nothing runs). Printed per variant:
XLA's temporaries and the largest buffer holding the scan-stacked block buffer (shape
[copies, 8, 1, T, D], read from the compiler's buffer assignment, which the script asks XLA to dump).

    .venv/bin/python benchmarks/attn_res_memory.py --length 2048 --hidden 256
Results: stdout table and benchmarks/results/attn_res_memory.json (--out to change).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import tempfile
import time

from common import cpu_only, machine, print_table, result_path, write_json

cpu_only()
DUMP = tempfile.mkdtemp(prefix="attn_res_memory_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax import config as C  # noqa: E402
from k3jax import model as M  # noqa: E402

K3_LAYOUT = ["model_name=tiny", "num_layers=93", "mla_extra_layers=[92]", "attn_res_block_size=12",
             "kda_impl=reference", "moe_impl=dense"]


def block_buffers(module: str, nb: int, t: int, d: int) -> list[int]:
    """Copies counts of every stacked block buffer f32[copies, nb, 1, t, d] in the dumped buffer
    assignment of ``module`` (the jit name), largest first."""
    files = sorted(glob.glob(os.path.join(DUMP, f"*{module}*buffer-assignment.txt")), key=os.path.getmtime)
    text = open(files[-1]).read()
    pat = re.compile(rf"f32\[(\d+),{nb},1,{t},{d}\]")
    return sorted({int(m.group(1)) for m in pat.finditer(text)}, reverse=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--out", default=result_path("attn_res_memory"))
    a = ap.parse_args()
    rows = []
    for seg in (False, True):
        cfg = C.load(C.REPO_CONFIGS / "base.yml", K3_LAYOUT + [f"hidden_size={a.hidden}",
                                                                f"attn_res_segment_scan={str(seg).lower()}"])
        model = nnx.eval_shape(lambda: M.build(cfg, nnx.Rngs(0)))
        gdef, state = nnx.split(model)
        nb = len(cfg.model.attn_res_block_starts)

        def loss(st, tokens):
            h, _, _ = nnx.merge(gdef, st).hidden(tokens, remat="full")
            return jnp.mean(h)
        t0 = time.time()
        lowered = jax.jit(jax.grad(loss)).trace(state, jax.ShapeDtypeStruct((1, a.length), jnp.int32)).lower()
        compiled = lowered.compile()
        ma = compiled.memory_analysis()
        copies = block_buffers("jit_loss", nb, a.length, a.hidden)
        one = nb * a.length * a.hidden * 4
        rows.append({"variant": "segment scan" if seg else "flat scan", "temp_mib": ma.temp_size_in_bytes / 2**20,
                     "copies": "+".join(map(str, copies)) or "-", "buffer_mib": sum(copies) * one / 2**20,
                     "compile_s": time.time() - t0})
    print(f"AttnRes block buffer in the compiled backward: K3 layout (93 layers, blocks of 12), D={a.hidden}, "
          f"T={a.length}, f32, remat=full")
    print_table(rows, [("variant", "variant", ""), ("XLA temp MiB", "temp_mib", ".1f"),
                       ("stacked block-buffer copies", "copies", ""), ("their MiB", "buffer_mib", ".1f"),
                       ("compile s", "compile_s", ".0f")])
    write_json(a.out, {"machine": machine(), "length": a.length, "hidden": a.hidden, "rows": rows})


if __name__ == "__main__":
    main()
