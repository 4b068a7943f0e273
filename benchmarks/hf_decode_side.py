"""The transformers side of benchmarks/decode_vs_hf.py (run with the golden venv's Python 3.11 +
torch CPU + transformers, never imported by k3jax).

    /work/venv-golden/bin/python benchmarks/hf_decode_side.py make OUT_DIR
        a random 8-layer Kimi Linear-shaped model (hidden 512, 32 experts top-4, vocab 8192),
        saved as float32 safetensors + config.json in OUT_DIR
    /work/venv-golden/bin/python benchmarks/hf_decode_side.py time OUT_DIR PROMPTS.json RESULT.json
        greedy generate() of each batch of prompts, eager attention and experts: new tokens and
        timings (prefill = generate(max_new_tokens=1); full = generate(max_new_tokens=N), and
        inside it the N - 1 decode steps from the first new token to the last, noted by a
        streamer), at each torch thread count the spec lists, keeping the fastest

A spec may name "device" (cpu | cuda), "dtype" (float32 | bfloat16) and "default_impl" (true:
transformers' default attention / experts implementations instead of eager); on cuda TF32 is off.
fla (its Triton KDA kernels, which transformers binds when importable) is blocked unless the
environment has K3JAX_HF_FLA=1 (decode_vs_hf.py --gpu sets it for the bfloat16 speed run).

The weights are random at scales that keep logits O(1..10) (as scripts/make_goldens.py does), so
greedy tokens are decided by clear margins and the two stacks can be compared token for token.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

if os.environ.get("K3JAX_HF_FLA") != "1":
    sys.modules.setdefault("fla", None)   # never bind fla's triton kernels unless asked (CPU box, f32 tokens)
# transformers imports accelerate when it finds it; this side needs none of it (no device_map), the
# CI venv has none, and the GPU image's accelerate was never run against the carried huggingface-hub.
sys.modules.setdefault("accelerate", None)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

IMPL = {"attn_implementation": "eager", "experts_implementation": "eager"}


def config() -> KimiLinearConfig:
    # Kimi Linear 48B's layout scaled down: KDA at 3 of every 4 layers, NoPE MLA at the 4th.
    kinds = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2
    return KimiLinearConfig(
        vocab_size=8192, hidden_size=512, num_hidden_layers=8, layer_types=kinds,
        linear_num_heads=4, linear_head_dim=128, linear_conv_kernel_dim=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, first_k_dense_replace=1,
        intermediate_size=1024, num_local_experts=32, num_experts_per_tok=4, n_shared_experts=1,
        moe_intermediate_size=256, routed_scaling_factor=2.446, n_group=1, topk_group=1,
        norm_topk_prob=True, hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False,
        pad_token_id=None, bos_token_id=1, eos_token_id=2, max_position_embeddings=4096)


def make(out: Path) -> None:
    torch.manual_seed(0)
    model = KimiLinearForCausalLM._from_config(config(), dtype=torch.float32, **IMPL).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            if name.endswith("A_log"):
                t.copy_(torch.rand(t.shape, generator=gen).mul(15.0).add(1.0).log())
            elif name.endswith("dt_bias") or name.endswith("e_score_correction_bias"):
                t.copy_(0.5 * torch.randn(t.shape, generator=gen))
            elif name.endswith("conv1d.weight"):
                t.copy_(0.5 * torch.randn(t.shape, generator=gen))
            elif t.ndim == 1:
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=gen))
            else:   # fan-in scaled so activations stay O(1) at width 512
                t.copy_(torch.randn(t.shape, generator=gen) * (1.5 / t.shape[-1] ** 0.5))
    model.save_pretrained(out, save_original_format=False)


class Clock(BaseStreamer):
    """A streamer that only notes when generate() hands it tokens: the prompt first, then each new
    token as soon as it is chosen (the prefill's, then one per decode forward)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


@torch.no_grad()
def timed(model, ids, new: int) -> tuple[float, torch.Tensor, float]:
    """-> (seconds of the whole generate, new tokens, seconds from the first new token to the last:
    the new - 1 decode steps, timed inside this one call)."""
    clock = Clock()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0, streamer=clock)
    total = time.perf_counter() - t0
    if ids.is_cuda:
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    if len(clock.times) != new + 1:
        raise RuntimeError(f"expected the prompt and {new} tokens streamed, got {len(clock.times)} calls")
    return total, out[:, ids.shape[1]:], clock.times[-1] - clock.times[1]


def time_all(out: Path, prompts_file: Path, result: Path) -> None:
    """Each batch at every torch thread count in the spec; the fastest full generate is kept (on
    shared cores 2 threads ran 5x slower than 1, so transformers gets its best setting)."""
    spec = json.loads(prompts_file.read_text())
    device, dtype = spec.get("device", "cpu"), getattr(torch, spec.get("dtype", "float32"))
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    impl = {} if spec.get("default_impl") else IMPL
    model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype, **impl).to(device).eval()
    used = {"attn_implementation": model.config._attn_implementation,
            "experts_implementation": getattr(model.config, "_experts_implementation", None),
            "fla": sys.modules.get("fla") is not None}
    rows = []
    for batch in spec["batches"]:
        ids = torch.tensor(batch["prompts"], dtype=torch.int64, device=device)
        new = spec["new_tokens"]
        tries = []
        for threads in spec.get("threads", [torch.get_num_threads()]):
            torch.set_num_threads(threads)
            timed(model, ids[:, :8], 2)                            # warm-up (allocator, threads)
            t_pre = min(timed(model, ids, 1)[0] for _ in range(2))
            t_all, toks, t_dec = timed(model, ids, new)
            tries.append({"threads": threads, "prefill_s": t_pre, "generate_s": t_all, "decode_s": t_dec,
                          "tokens": toks.tolist()})
            print(f"transformers batch {ids.shape[0]}, {threads} threads: prefill {t_pre:.3f} s, generate "
                  f"{t_all:.2f} s, of which {new - 1} decode steps {t_dec:.2f} s", file=sys.stderr, flush=True)
        best = min(tries, key=lambda r: r["generate_s"])
        rows.append({"batch": ids.shape[0], **best, "impl": used, "dtype": spec.get("dtype", "float32"), "same_tokens_every_thread_count":
                     all(r["tokens"] == best["tokens"] for r in tries),
                     "tries": [{k: v for k, v in r.items() if k != "tokens"} for r in tries]})
    import transformers
    result.write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                  "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                                  "impl": used, "rows": rows}))


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "make":
        make(Path(args[0]))
    else:
        time_all(Path(args[0]), Path(args[1]), Path(args[2]))
