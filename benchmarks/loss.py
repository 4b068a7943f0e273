"""Training cross-entropy (lm head + softmax CE), forward+backward: ours (loss_impl=chunked) beside
tokamax's fused op (loss_impl=tokamax), k3jax.loss.

Part 1 times, jitted, the median of N runs after a warm-up, `jax.value_and_grad` wrt the final
hidden states h [B, T, D] and the lm head w [D, V] of the masked mean loss, on the default backend
(CPU here: tokamax's chunked_xla loop, relative numbers only), and prints the temp memory XLA plans
for each (compile().memory_analysis()).

Part 2 (--aot TOPOLOGY, e.g. v5p:2x2x1) compiles the same function for one TPU chip of that
topology from this host (libtpu; tokamax's Mosaic kernel for loss_impl=tokamax) at the K3 lm-head
shape, 4096 tokens of one sequence (B=1, T=4096, D=7168, V=163840, h bf16, w --aot-weight-dtype),
and prints the compiled memory (temp, arguments, outputs); the JSON adds cost_analysis's FLOPs and
bytes, which are not comparable between the two (XLA counts a while loop's body once).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/loss.py                     # CPU table + JSON
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/loss.py --aot v5p:2x2x1     # adds the TPU compile

Part 3 (--aot-mesh TOPOLOGY) compiles it for every chip of the topology as one sharded program, as
the train step runs it: mesh fsdp=2 x expert=chips/2, one row of 4096 tokens per chip, the lm head
(--aot-weight-dtype) laid out by sharding.param_sharding, ours (chunked, GSPMD) beside loss_impl=vocab_parallel
(the vocabulary group chosen as the train step chooses it, and fsdp alone), and prints the compiled
memory per chip and whether the program holds a whole [D, V] head or gradient anywhere:

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/loss.py --no-cpu --aot-mesh v5p:2x2x1
Results: stdout tables and benchmarks/results/loss.json (--out to change).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_only, machine, median_time, print_table, result_path, write_json  # noqa: E402

K3 = dict(B=1, T=4096, D=7168, V=163840)


def _fn(impl: str, chunk: int, implementation: str):
    import jax
    import jax.numpy as jnp
    from k3jax.loss import chunked_cross_entropy, tokamax_context, tokamax_cross_entropy

    def loss(h, w, t, m):
        if impl == "chunked":
            s, n, _ = chunked_cross_entropy(h, w, t, m, chunk=chunk)
        else:
            s, n, _ = tokamax_cross_entropy(h, w, t, m, implementation=implementation)
        return s / jnp.maximum(n, 1.0)

    grad = jax.value_and_grad(loss, argnums=(0, 1))

    def traced(*a):
        with tokamax_context(implementation if impl == "tokamax" else "none"):
            return grad(*a)
    return jax.jit(traced)


def _inputs(b, t, d, v, dtype, w_dtype):
    import jax
    import jax.numpy as jnp
    k = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k[0], (b, t, d)).astype(dtype)
    w = (jax.random.normal(k[1], (d, v)) * d ** -0.5).astype(w_dtype)
    tg = jax.random.randint(k[2], (b, t), 0, v)
    return h, w, tg, jnp.ones((b, t), jnp.float32)


def _mem(compiled) -> dict:
    m = compiled.memory_analysis()
    return {"temp_bytes": m.temp_size_in_bytes, "argument_bytes": m.argument_size_in_bytes,
            "output_bytes": m.output_size_in_bytes}


def cpu_part(a) -> list[dict]:
    import jax
    import jax.numpy as jnp
    args = _inputs(a.batch, a.seq, a.d_model, a.vocab, jnp.float32, jnp.float32)
    rows, want = [], None
    for impl in ("chunked", "tokamax"):
        fn = _fn(impl, a.chunk, "chunked_xla")
        t0 = time.perf_counter()
        compiled = fn.lower(*args).compile()
        compile_s = time.perf_counter() - t0
        out = jax.block_until_ready(compiled(*args))
        sec, _ = median_time(lambda: jax.block_until_ready(compiled(*args)), warmup=1, repeats=a.repeats)
        want = want or out
        diff = max(float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y))) for x, y in
                   zip(jax.tree.leaves(out), jax.tree.leaves(want)))
        rows.append({"impl": impl, "step_ms": 1e3 * sec, "compile_s": compile_s,
                     "tokens_per_s": a.batch * a.seq / sec, "max_rel_diff_vs_chunked": diff,
                     **_mem(compiled)})
    for r in rows:
        r["vs_chunked"] = rows[0]["step_ms"] / r["step_ms"]
        r["temp_mib"] = r["temp_bytes"] / 2 ** 20
    print(f"loss fwd+bwd on {jax.default_backend()} ({os.cpu_count()} cores), B={a.batch} T={a.seq} "
          f"D={a.d_model} V={a.vocab} f32, loss_chunk_size={a.chunk}")
    print_table(rows, [("impl", "impl", "s"), ("step ms", "step_ms", ".1f"), ("tokens/s", "tokens_per_s", ".0f"),
                       ("vs chunked", "vs_chunked", ".2f"), ("temp MiB", "temp_mib", ".1f"),
                       ("max rel diff", "max_rel_diff_vs_chunked", ".1e"), ("compile s", "compile_s", ".1f")])
    return rows


def aot_part(a) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    topo = topologies.get_topology_desc(topology_name=a.aot, platform="tpu")
    mesh = Mesh(topo.devices[:1], ("data",))
    s = NamedSharding(mesh, P())
    b, t, d, v = K3["B"], K3["T"], K3["D"], K3["V"]
    args = (jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16, sharding=s),
            jax.ShapeDtypeStruct((d, v), jnp.dtype(a.aot_weight_dtype), sharding=s),
            jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=s),
            jax.ShapeDtypeStruct((b, t), jnp.float32, sharding=s))
    rows = []
    for impl in ("chunked", "tokamax"):
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):   # tokamax reads the TPU generation from the ambient mesh
            lowered = _fn(impl, a.chunk, "mosaic_tpu").trace(*args).lower()
        compiled = lowered.compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        row = {"impl": impl, "compile_s": time.perf_counter() - t0,
               "mosaic_kernel": "tpu_custom_call" in lowered.as_text(), **_mem(compiled),
               "flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed")}
        for k in ("temp", "argument", "output"):
            row[f"{k}_gib"] = row[f"{k}_bytes"] / 2 ** 30
        row["tflop"] = row["flops"] / 1e12 if row["flops"] is not None else None
        row["gb_accessed"] = row["bytes_accessed"] / 1e9 if row["bytes_accessed"] is not None else None
        rows.append(row)
    print(f"\nloss fwd+bwd AOT for one {a.aot} chip: B={b} T={t} D={d} V={v}, h bf16, w {a.aot_weight_dtype}")
    print_table(rows, [("impl", "impl", "s"), ("Mosaic kernel", "mosaic_kernel", ""), ("temp GiB", "temp_gib", ".2f"),
                       ("args GiB", "argument_gib", ".2f"), ("outputs GiB", "output_gib", ".2f"),
                       ("compile s", "compile_s", ".1f")])
    print("(cost_analysis FLOPs/bytes are in the JSON but not comparable: XLA counts a while loop's body once, "
          "so ours shows one chunk of its scan, while the Mosaic calls carry the kernel's whole estimate)")
    return rows


def aot_mesh_part(a) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from k3jax.loss import choose_vocab_axes, chunked_cross_entropy, vocab_parallel_cross_entropy
    from k3jax.sharding import BATCH_AXES, CONTEXT_AXIS, MESH_AXES, VOCAB_PARALLEL_AXES, param_sharding
    topo = topologies.get_topology_desc(topology_name=a.aot_mesh, platform="tpu")
    n = len(topo.devices)
    shape = {"data": 1, "fsdp": 2, "context": 1, "expert": n // 2, "tensor": 1}
    mesh = Mesh(np.asarray(topo.devices).reshape([shape[x] for x in MESH_AXES]), MESH_AXES)
    b, t, d, v = n, K3["T"], K3["D"], K3["V"]
    rows = NamedSharding(mesh, P(BATCH_AXES))
    w_sharding = param_sharding(mesh, (d, v), ("embed", "vocab"))
    args = (jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16, sharding=NamedSharding(mesh, P(BATCH_AXES, None, None))),
            jax.ShapeDtypeStruct((d, v), jnp.dtype(a.aot_weight_dtype), sharding=w_sharding),
            jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rows), jax.ShapeDtypeStruct((b, t), jnp.float32, sharding=rows))
    auto = choose_vocab_axes(mesh, b, t, v, batch_axes=BATCH_AXES, seq_axis=CONTEXT_AXIS, candidates=VOCAB_PARALLEL_AXES)
    impls = [("chunked", None), ("vocab_parallel", auto)] + ([("vocab_parallel", ("fsdp",))] if auto != ("fsdp",) else [])
    out = []
    for impl, axes in impls:
        def loss(h, w, tg, m, impl=impl, axes=axes):
            if impl == "chunked":
                s, k, _ = chunked_cross_entropy(h, w, tg, m, chunk=a.chunk)
            else:
                s, k, _ = vocab_parallel_cross_entropy(h, w, tg, m, chunk=a.chunk, vocab_axes=axes,
                                                       batch_axes=BATCH_AXES, seq_axis=CONTEXT_AXIS)
            return s / jnp.maximum(k, 1.0)
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            # the gradients leave laid out like h and the head, as the train step pins them
            compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)),
                               out_shardings=(NamedSharding(mesh, P()), (args[0].sharding, w_sharding))
                               ).trace(*args).lower().compile()
        text = compiled.as_text()
        row = {"impl": impl if axes is None else f"{impl} {'x'.join(axes)}", "compile_s": time.perf_counter() - t0,
               "whole_head": any(f"{dt}[{d},{v}]" in text for dt in ("f32", "bf16")), **_mem(compiled)}
        for k in ("temp", "argument", "output"):
            row[f"{k}_gib"] = row[f"{k}_bytes"] / 2 ** 30
        out.append(row)
    print(f"\nloss fwd+bwd AOT for {a.aot_mesh} as one program, mesh {shape}: B={b} (one row per chip) T={t} D={d} "
          f"V={v}, h bf16, lm head {a.aot_weight_dtype} sharded {w_sharding.spec}, loss_chunk_size={a.chunk}; memory per chip")
    print_table(out, [("impl", "impl", "s"), ("whole [D,V] in HLO", "whole_head", ""), ("temp GiB", "temp_gib", ".2f"),
                      ("args GiB", "argument_gib", ".2f"), ("outputs GiB", "output_gib", ".2f"),
                      ("compile s", "compile_s", ".1f")])
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=1024, help="loss_chunk_size of ours")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--aot", default=None, help="also AOT-compile for this TPU topology at the K3 shape")
    p.add_argument("--aot-weight-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--aot-mesh", default=None, help="also AOT-compile sharded over every chip of this TPU topology")
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU timing (part 1)")
    p.add_argument("--out", default=result_path("loss"))
    a = p.parse_args(argv)
    cpu_only()
    payload = {"benchmark": "loss", "machine": machine()}
    if not a.no_cpu:
        payload["cpu"] = cpu_part(a)
    if a.aot:
        payload["aot"] = {"topology": a.aot, "shape": K3, "weight_dtype": a.aot_weight_dtype, "rows": aot_part(a)}
    if a.aot_mesh:
        payload["aot_mesh"] = {"topology": a.aot_mesh, "tokens_per_chip": K3["T"], "weight_dtype": a.aot_weight_dtype,
                               "rows": aot_mesh_part(a)}
    write_json(a.out, payload)


if __name__ == "__main__":
    main()
