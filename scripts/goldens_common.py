"""What the golden-asset scripts share (scripts/make_goldens.py, make_vision_goldens.py,
make_convert_assets.py; run in the golden venv of make_goldens.py's docstring): the repository
root, the eager implementations every reference model is built with, the seeded weight
randomizer, and the routing-margin check that keeps a reimplementation's expert choice stable.
"""
from __future__ import annotations

from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
# Smallest allowed gap between the last chosen and the first rejected (biased) router score, and
# between the last chosen and first rejected group score: a reimplementation whose float32
# rounding differs by ~1e-6 must pick the same experts.
MIN_ROUTING_MARGIN = 1e-4
IMPLEMENTATIONS = {"attn_implementation": "eager", "experts_implementation": "eager"}

# Weight scales (see README): large enough that logits are O(1..10) and every component matters.
MATRIX_STD = 0.15  # every projection, embedding, expert and router matrix
CONV_STD = 0.5  # depthwise short conv taps: larger so the silu after the conv is non-linear
NORM_STD = 0.1  # norm weights are 1 + N(0, NORM_STD)
DT_BIAS_STD = 0.5
CORRECTION_BIAS_STD = 0.5  # non-zero so biased and unbiased router weights differ


def randomize_(model: torch.nn.Module, seed: int) -> dict[str, str]:
    """Overwrite every persistent tensor of `model` in place with seeded random values.

    Tensors are visited in sorted-name order so the result depends only on the seed and the set
    of names. Returns {name: rule} for the README/meta. Non-persistent buffers (RoPE inv_freq) are
    derived from the config and left alone.
    """
    gen = torch.Generator().manual_seed(seed)
    rules: dict[str, str] = {}
    state = model.state_dict()
    with torch.no_grad():
        for name in sorted(state):
            t = state[name]
            if name.endswith("A_log"):
                # KDA per-head decay rate exp(A_log) ~ U(1, 16), the FLA/transformers init law.
                t.copy_(torch.rand(t.shape, generator=gen).mul(15.0).add(1.0).log())
                rule = "log(U(1,16))"
            elif name.endswith("dt_bias"):
                t.copy_(torch.randn(t.shape, generator=gen) * DT_BIAS_STD)
                rule = f"N(0,{DT_BIAS_STD})"
            elif name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=gen) * CORRECTION_BIAS_STD)
                rule = f"N(0,{CORRECTION_BIAS_STD})"
            elif name.endswith("conv1d.weight"):
                t.copy_(torch.randn(t.shape, generator=gen) * CONV_STD)
                rule = f"N(0,{CONV_STD})"
            elif t.ndim == 1:
                if "norm" not in name:
                    raise ValueError(f"unexpected 1-D tensor {name}: extend randomize_")
                t.copy_(1.0 + torch.randn(t.shape, generator=gen) * NORM_STD)
                rule = f"1+N(0,{NORM_STD})"
            else:
                t.copy_(torch.randn(t.shape, generator=gen) * MATRIX_STD)
                rule = f"N(0,{MATRIX_STD})"
            rules[name] = rule
    return rules


@torch.no_grad()
def routing_margins(model, input_ids: torch.Tensor, **inputs) -> list[dict[str, float | None]]:
    """Per MoE layer, the smallest top-k decision margins over all tokens of a full forward
    (`inputs`: further model kwargs, e.g. the pixels of a multimodal prompt).

    Recomputes the router's selection scores s + b from the router's input (a forward hook), and
    returns {"expert": min over tokens of (k-th - (k+1)-th selection score among experts of the
    chosen groups), "group": same for the group scores (None when every group is kept)}.
    """
    margins: list[dict[str, float | None]] = []

    def hook(router, args, _out):
        h = args[0].reshape(-1, router.hidden_dim).float()
        s = torch.sigmoid(h @ router.weight.float().T) + router.e_score_correction_bias
        n_group, n_exp = router.num_group, router.num_experts
        group_scores = s.view(-1, n_group, n_exp // n_group).topk(2, dim=-1)[0].sum(-1)
        group_margin = None
        if router.topk_group < n_group:
            srt = group_scores.sort(dim=-1, descending=True)[0]
            group_margin = float((srt[:, router.topk_group - 1] - srt[:, router.topk_group]).min())
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(router.topk_group, dim=-1)[1], 1)
        keep = keep.bool().repeat_interleave(n_exp // n_group, dim=1)
        srt = s.masked_fill(~keep, float("-inf")).sort(dim=-1, descending=True)[0]
        expert_margin = float((srt[:, router.top_k - 1] - srt[:, router.top_k]).min())
        margins.append({"group": group_margin, "expert": expert_margin})

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]
    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        model(input_ids=input_ids, **({"use_cache": False} | inputs))
    finally:
        for handle in handles:
            handle.remove()
    return margins
