"""Does activation offload to host memory compile for TPU from this CPU host, and does the compiled
program show it? (issue 53's probe, before any offload remat policy is built)

A scanned stack of L layers whose per-layer residual is named ``mixer_out`` (as k3jax names the
mixer output), differentiated under two remat policies, AOT-compiled for v5p:2x2x1 (fsdp=4) with
libtpu: saving the name on device (``save_only_these_names``) and offloading it to pinned host
memory (``save_and_offload_only_these_names(..., offload_dst="pinned_host")``). Per policy:
``memory_analysis()`` (device and host temporaries) and the compiled HLO's host memory space
annotations (``S(5)``) and async copies. Expected host bytes per device for the offload policy:
L x (B / 4) x D x 2 (bf16).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/offload_probe.py [--out PATH]
"""
from __future__ import annotations

import argparse
import os

from common import print_table, result_path, write_json

os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

L, B, D = 8, 4096, 1024
POLICIES = {
    "save mixer_out on device": jax.checkpoint_policies.save_only_these_names("mixer_out"),
    "offload mixer_out to pinned_host": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["mixer_out"],
        offload_src="device", offload_dst="pinned_host"),
}


def layer(w, x):
    h = checkpoint_name(jnp.tanh(x @ w), "mixer_out")
    return jnp.tanh(h @ w.T)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=result_path("offload_probe"))
    a = ap.parse_args()
    devices = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices
    mesh = jax.make_mesh((4,), ("fsdp",), devices=devices, axis_types=(AxisType.Auto,))
    ws = jax.ShapeDtypeStruct((L, D, D), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, None, "fsdp")))
    x = jax.ShapeDtypeStruct((B, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    rows = []
    for name, policy in POLICIES.items():
        def loss(ws, x, policy=policy):
            f = jax.checkpoint(layer, policy=policy)
            y, _ = jax.lax.scan(lambda h, w: (f(w, h), None), x, ws)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        with jax.set_mesh(mesh):
            compiled = jax.jit(jax.grad(loss)).lower(ws, x).compile()
        m, text = compiled.memory_analysis(), compiled.as_text()
        rows.append({"policy": name, "device_temp_mib": m.temp_size_in_bytes / 2**20,
                     "host_temp_mib": m.host_temp_size_in_bytes / 2**20,
                     "host_memory_space_annotations": text.count("S(5)"),
                     "copy_start": text.count("copy-start"), "copy_done": text.count("copy-done")})
    print_table(rows, [("policy", "policy", "s"), ("device temp MiB", "device_temp_mib", ".2f"),
                       ("host temp MiB", "host_temp_mib", ".2f"), ("S(5) in HLO", "host_memory_space_annotations", "d"),
                       ("copy-start", "copy_start", "d"), ("copy-done", "copy_done", "d")])
    print(f"expected host bytes per device if every layer's mixer_out is offloaded: {L * B // 4 * D * 2 / 2**20:.2f} MiB")
    write_json(a.out, {"topology": "v5p:2x2x1", "mesh": {"fsdp": 4}, "L": L, "B": B, "D": D, "rows": rows})


if __name__ == "__main__":
    main()
