"""The remat policies that offload to host memory against their device-only equivalents, on the tiny
K3's train step AOT-compiled for v5p:2x2x1 (fsdp=4) from this CPU host (issue 53, item 1).

Per policy: device temporaries and host bytes per device (``memory_analysis()``), the copies to host
memory per checkpoint name in the traced step (``k3jax.compile.host_moves``: copies per step and
their bytes over all devices), and the compiled program's host-memory buffers (``S(5)``) and async
copies. The shape (4 layers, D = 256, 64 rows x 64 tokens per device) makes the saved tensors large
beside the rest of the step; at the tests' 2 rows per device an offload's device temporaries come out
slightly above its equivalent's (the async copies' staging buffers).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/offload_policies.py [--policies ...] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import time

from common import print_table, result_path, write_json

from k3jax import compile as K
from k3jax import config as C
from k3jax import remat as R

ARGS = ["model_name=tiny", "num_layers=4", "mla_extra_layers=[]", "attn_res_block_size=2", "opt_type=adamw",
        "use_qk_clip=false", "hidden_size=256", "per_device_batch_size=64", "compile_topology=v5p:2x2x1",
        "ici_fsdp_parallelism=4"]
# a policy, or twin:<policy> for its device-only equivalent (k3jax.remat.device_only)
POLICIES = ["full", "save_mixer_out", "offload_mixer_out", "twin:offload_kda", "offload_kda"]


def measure(args: list[str], policy: str) -> dict:
    cfg = C.load_from_argv(args + [f"remat_policy={policy.removeprefix('twin:')}"])
    if policy.startswith("twin:"):
        cfg = C.override(cfg, R.device_only(cfg.train))
    topo, mesh = K.topology_mesh(cfg, "v5p:2x2x1")
    moves: dict = {}
    t0 = time.process_time()
    compiled, secs, _ = K.compile_train(cfg, mesh, on_trace=lambda jx: moves.update(K.host_moves(jx)))
    mem, copies = K.memory_report(compiled, topo.chip.hbm_bytes), K.host_copies(compiled)
    t = cfg.train
    label = t.remat_policy + (f" [{', '.join(t.remat_save_names)}]" if t.remat_policy == "custom" else "")
    return {"policy": label, "device_temp_mib": mem["temporaries"] / 2**20,
            "host_mib": mem["host_temporaries"] / 2**20,
            "moves": ", ".join(f"{k} {v['moves']}" for k, v in sorted(moves.items())) or "-",
            "moved_mib": sum(v["bytes"] for v in moves.values()) / 2**20,
            "s5": copies["host_memory_space"], "copy_start": copies["copy_start"],
            "compile_cpu_s": time.process_time() - t0, "compile_wall_s": secs, "per_name": moves}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--set", nargs="*", default=[], help="extra key=value overrides")
    ap.add_argument("--out", default=result_path("offload_policies"))
    a = ap.parse_args()
    rows = []
    for p in a.policies:
        rows.append(measure(ARGS + a.set, p))
        print(f"{rows[-1]['policy']}: compiled in {rows[-1]['compile_wall_s']:.0f} s", flush=True)
    print_table(rows, [("policy", "policy", "s"), ("device temp MiB", "device_temp_mib", ".2f"),
                       ("host MiB", "host_mib", ".2f"), ("copies to host per step", "moves", "s"),
                       ("their MiB (all devices)", "moved_mib", ".2f"), ("S(5)", "s5", "d"),
                       ("copy-start", "copy_start", "d")])
    write_json(a.out, {"topology": "v5p:2x2x1", "args": ARGS + a.set, "rows": rows})


if __name__ == "__main__":
    main()
