"""MoE kernels: routing, grouped matmul, dropless / capacity dispatch, EP, load balancing.

Pure jax functions (no flax, no config objects); the Flax layer in `k3jax.layers` composes them:

    weights, idx = route(logits, bias, top_k=16)                       # routing.py
    out = moe_dropless(x, weights, idx, w_gate, w_up, w_down, act)     # dispatch.py, one device
    out = moe_expert_parallel(..., mesh=mesh)                          # expert_parallel.py
    bias = update_bias(bias, expert_load(idx, E), rate)                # balance.py

Contracts and cost notes: docs/moe.md.
"""
from k3jax.kernels.moe.balance import expert_load, load_stats, sequence_aux_loss, update_bias
from k3jax.kernels.moe.dispatch import moe_capacity, moe_dense_reference, moe_dropless
from k3jax.kernels.moe.expert_parallel import dispatch_bytes_per_token, moe_expert_parallel
from k3jax.kernels.moe.gmm import grouped_matmul
from k3jax.kernels.moe.routing import route, router_scores

__all__ = [
    "route", "router_scores", "grouped_matmul", "moe_dropless", "moe_capacity",
    "moe_dense_reference", "moe_expert_parallel", "dispatch_bytes_per_token", "expert_load",
    "update_bias", "sequence_aux_loss", "load_stats",
]
