"""The config schema: one frozen dataclass per section, each field a key with its default, help
text and allowed choices. ``k3jax.config`` loads, coerces and validates values against it and
re-exports every name here; modules import them from ``k3jax.config``."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from k3jax.errors import ConfigError  # noqa: F401 - re-exported with the schema (modules import it from here)


def _f(default, help: str, choices: tuple | None = None):  # noqa: A002 - mirrors argparse
    kw = {"default_factory": (lambda d=default: list(d))} if isinstance(default, list) else {"default": default}
    return dataclasses.field(metadata={"help": help, "choices": choices}, **kw)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture. Defaults are a tiny K3-shaped model; configs/models/*.yml override them."""
    vocab_size: int = _f(512, "vocabulary size (embedding and lm_head rows)")
    hidden_size: int = _f(64, "model width D")
    num_layers: int = _f(13, "decoder layers")
    rms_norm_eps: float = _f(1e-5, "eps of input/post-attention/final/AttnRes/o_norm/latent norms")
    initializer_range: float = _f(0.02, "std of normal init for embeddings and matrices")
    tie_word_embeddings: bool = _f(False, "share embedding and lm_head")
    max_position_embeddings: int = _f(4096, "context length recorded for export (HF config.json); decode sizes its cache from the prompt")
    bos_token_id: int = _f(-1, "[BOS] id written to an exported HF config; k3jax reads special ids from the tokenizer (-1 = none)")
    eos_token_id: int = _f(-1, "[EOS] id written to an exported HF config (-1 = none)")
    pad_token_id: int = _f(-1, "padding id written to an exported HF config (-1 = none)")
    # Layer schedule: MLA where l % mla_every == mla_every - 1, plus mla_extra_layers; KDA elsewhere.
    mla_every: int = _f(4, "MLA period: layer l is MLA when l % mla_every == mla_every-1 (1 = all MLA, 0 = only mla_extra_layers)")
    mla_extra_layers: list = _f([12], "further 0-based MLA layers (K3: [92]; Kimi Linear 48B: [26])")
    first_k_dense: int = _f(1, "leading layers with a dense FFN; the rest use MoE")
    # KDA
    kda_num_heads: int = _f(2, "KDA heads")
    kda_head_dim: int = _f(16, "KDA head dim (K = V)")
    kda_conv_size: int = _f(4, "causal depthwise short-conv width")
    kda_gate: str = _f("bounded", "decay gate: bounded = lb*sigmoid(exp(A)*(f+dt)) (K3); softplus (Kimi Linear)", ("bounded", "softplus"))
    kda_gate_lower_bound: float = _f(-5.0, "lower bound of the bounded gate, per token")
    kda_gate_rank: int = _f(16, "rank of the f_a/f_b decay projection")
    kda_output_gate: str = _f("full", "output gate: full-rank g_proj (K3) or low_rank g_a/g_b (Kimi Linear)", ("full", "low_rank"))
    kda_output_gate_rank: int = _f(16, "rank of the low-rank output gate")
    # Gated MLA
    num_attention_heads: int = _f(2, "MLA heads")
    q_lora_rank: Optional[int] = _f(32, "query LoRA rank; null = direct q_proj")
    kv_lora_rank: int = _f(32, "compressed KV latent width (cached)")
    qk_nope_head_dim: int = _f(16, "per-head query/key dims without position")
    qk_rope_head_dim: int = _f(8, "per-head 'rope' slice; the key slice is shared by all heads")
    v_head_dim: int = _f(16, "per-head value dim")
    mla_use_output_gate: bool = _f(True, "elementwise sigmoid output gate after attention (K3)")
    mla_use_rope: bool = _f(False, "rotate the rope slice (K2/DeepSeek-V3); K3 and Kimi Linear are NoPE")
    rope_theta: float = _f(10000.0, "RoPE base")
    rope_scaling_factor: float = _f(1.0, "YaRN factor; 1 = no scaling")
    rope_original_max_position: int = _f(4096, "YaRN original context length")
    rope_beta_fast: float = _f(32.0, "YaRN beta_fast")
    rope_beta_slow: float = _f(1.0, "YaRN beta_slow")
    rope_mscale: float = _f(1.0, "YaRN mscale")
    rope_mscale_all_dim: float = _f(0.0, "YaRN mscale_all_dim (softmax-scale correction)")
    # FFN
    ffn_activation: str = _f("situ", "GLU activation: situ (K3) or swiglu (Kimi Linear, K2)", ("situ", "swiglu"))
    situ_beta: float = _f(4.0, "SiTU gate-branch beta")
    situ_linear_beta: float = _f(25.0, "SiTU linear-branch beta")
    intermediate_size: int = _f(128, "dense FFN width (layers < first_k_dense)")
    # MoE
    num_experts: int = _f(8, "routed experts")
    num_experts_per_token: int = _f(2, "top-k")
    num_shared_experts: int = _f(1, "shared experts (one fused MLP of width n * moe_intermediate_size)")
    moe_intermediate_size: int = _f(32, "routed expert width F")
    moe_latent_size: Optional[int] = _f(48, "latent width of routed experts (K3 LatentMoE); null = full width")
    moe_latent_norm: bool = _f(True, "RMSNorm of the combined routed output in the latent (K3)")
    routed_scaling_factor: float = _f(1.0, "multiplier of the routed combine weights")
    moe_renormalize: bool = _f(True, "renormalise top-k weights to sum 1")
    router_weights_from_biased: bool = _f(False, "gather weights from biased scores (Kimi Linear remote-code quirk)")
    n_group: int = _f(1, "expert groups for grouped top-k")
    topk_group: int = _f(1, "groups kept in grouped top-k")
    experts_format: str = _f("dense", "routed-expert weights in memory: dense (weight_dtype) | mxfp4 (packed E2M1 codes + E8M0 "
                             "scale per 32 inputs, 4.25 bits; decode/serve; training needs freeze=[experts])", ("dense", "mxfp4"))
    experts_qat: str = _f("none", "quantization-aware training of the routed experts: none | mxfp4 (the forward uses the "
                          "dense master weights rounded as the converter packs MXFP4, the gradient passes straight "
                          "through; export with k3jax_to_hf --experts_format mxfp4)", ("none", "mxfp4"))
    # Block Attention Residuals
    attn_res: bool = _f(True, "Block Attention Residuals (K3) instead of plain residual adds")
    attn_res_block_size: int = _f(8, "decoder layers per AttnRes block (K3: 12)")

    # -- derived ------------------------------------------------------------------------------
    @property
    def mla_layer_set(self) -> frozenset:
        p = self.mla_every
        per = {l for l in range(self.num_layers) if p and l % p == p - 1}
        return frozenset(per | set(self.mla_extra_layers))

    def mixer(self, layer: int) -> str:
        return "mla" if layer in self.mla_layer_set else "kda"

    def ffn(self, layer: int) -> str:
        return "dense" if layer < self.first_k_dense else "moe"

    @property
    def schedule(self) -> list[tuple[str, str]]:
        """Per layer (mixer, ffn) kinds, e.g. [("kda", "dense"), ("kda", "moe"), ...]."""
        return [(self.mixer(l), self.ffn(l)) for l in range(self.num_layers)]

    @property
    def attn_res_block_starts(self) -> list[int]:
        if not self.attn_res:
            return []
        return list(range(0, self.num_layers, self.attn_res_block_size))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def routed_width(self) -> int:
        """Width the routed experts see: the latent (K3) or the model width."""
        return self.moe_latent_size or self.hidden_size


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The MoonViT3d vision tower and projector (docs/vision.md). Defaults: a tiny tower, off."""
    vision_enabled: bool = _f(False, "build the vision tower and projector (Kimi K2.5 / K3 VL); false = text-only")
    vision_patch_size: int = _f(14, "square patch side p in pixels (one patch = 3*p*p inputs)")
    vision_merge_kernel_size: int = _f(2, "side k of the k x k patch merge (sd2_tpool): k*k patches form one text token")
    vision_hidden_size: int = _f(32, "tower width D (K2.5: 1152, K3: 1024)")
    vision_num_layers: int = _f(2, "tower blocks (27)")
    vision_num_heads: int = _f(2, "attention heads H (K2.5: 16, K3: 12)")
    vision_head_dim: int = _f(16, "per-head dim Dh, a multiple of 4 (K2.5: 72, K3: 128); qkv width H*Dh may differ from D")
    vision_mlp_dim: int = _f(64, "MLP width (K2.5: 4304, K3: 4096)")
    vision_mlp_activation: str = _f("gelu_tanh", "MLP activation: gelu_tanh (both) | gelu (erf)", ("gelu_tanh", "gelu"))
    vision_norm: str = _f("layernorm", "block and final norms: layernorm with bias (K2.5) | rmsnorm, weight only (K3)",
                          ("layernorm", "rmsnorm"))
    vision_norm_eps: float = _f(1e-5, "eps of the tower norms (K2.5: 1e-5; K3: 1.1920929e-7, fp32 machine eps)")
    vision_patch_bias: bool = _f(True, "bias of the patch-embedding projection (K2.5: true, K3: false)")
    vision_attn_bias: bool = _f(True, "biases of wqkv and wo (K2.5: true, K3: false)")
    vision_mlp_bias: bool = _f(True, "biases of fc0 and fc1 (K2.5: true, K3: false)")
    vision_pos_emb_height: int = _f(8, "rows of the learned spatial position table (released: 64)")
    vision_pos_emb_width: int = _f(8, "columns of the learned spatial position table (released: 64)")
    vision_pos_emb_time: int = _f(4, "most frames per media item (t); t > 1 adds the fixed sin-cos temporal term")
    vision_pos_interp: str = _f("bicubic", "resampling of the position table to each grid, align_corners=False, no "
                                "antialias: bicubic (Keys a=-0.75, K2.5) | bilinear (K3)", ("bicubic", "bilinear"))
    vision_pos_add_dtype: str = _f("float32", "dtype of patch + position-embedding add (the references disagree, "
                                   "docs/vision.md §11.6): float32 (summed in f32, rounded once to the activation "
                                   "dtype) | compute (the position term cast to the activation dtype, then added)",
                                   ("float32", "compute"))
    vision_rope_theta: float = _f(10000.0, "base of the 2-D RoPE (interleaved pairs: even pairs by column, odd by row)")
    vision_merge: str = _f("sd2_tpool", "patch merge: sd2_tpool (k x k spatial groups, mean over frames)", ("sd2_tpool",))
    vision_projector: str = _f("patchmerger", "projector: patchmerger (K2.5: LayerNorm per sub-patch, Linear+b, GELU, "
                               "Linear+b) | patchmergerv2 (K3: Linear, GELU, Linear, no biases, RMSNorm after)",
                               ("patchmerger", "patchmergerv2"))
    vision_projector_hidden_size: Optional[int] = _f(None, "projector hidden width; null = its input width k*k*D (both releases)")
    vision_projector_eps: float = _f(1e-5, "eps of the projector's pre-norm (patchmerger) or post-norm (patchmergerv2)")
    vision_attention_impl: str = _f("blocked", "tower attention within each media item: blocked (query blocks against "
                                    "all keys with a segment-id mask, O(block x N) memory, any platform) | splash (TPU "
                                    "splash attention with segment ids)", ("blocked", "splash"))
    vision_attention_block: int = _f(512, "blocked: query rows per block")
    vision_param_sharding: str = _f("sharded", "tower and projector weights on a mesh: sharded (by their logical axes, "
                                    "as text weights: gathered for use) | replicated (whole on every device, "
                                    "gradients all-reduced)", ("sharded", "replicated"))
    # Host-side processor (k3jax.data.vision_processor; docs/vision.md §1). Defaults: K3's media_proc_cfg.
    vision_in_patch_limit: int = _f(65536, "patch budget of one image before padding (K3: 65536, K2.5: 16384)")
    vision_side_limit: int = _f(512, "most patches on one side of an image")
    vision_transparent_bg: str = _f("chessboard", "under transparent pixels: chessboard (K3: 8-px white/180 squares, "
                                    "after the resize) | none (K2.5: alpha dropped)", ("chessboard", "none"))
    vision_image_prompt_size: bool = _f(True, "image prompt names the size: 'image {W}x{H}' (K3) or 'image' (K2.5)")
    vision_video: bool = _f(False, "accept video (K2.5: frames in chunks of 4 with timestamps); K3 is image-only")
    vision_frame_patch_limit: int = _f(4096, "video: patch budget of one frame (K2.5: 4096)")
    vision_sample_fps: float = _f(2.0, "video: frames kept per second (at most the source's)")
    vision_max_images: int = _f(16, "most images + videos in one example or request; more is an error (0 = no limit)")
    vision_patch_buckets: list = _f([], "packed patch counts the tower compiles for, padded to the smallest that "
                                    "holds them: per row in training (the batch's fullest row), per prompt batch "
                                    "in decode and per tower call in the server; [] = powers of two from 256")

    @property
    def qkv_width(self) -> int:
        """Width of q, k and v each (H * Dh); K3's 1536 differs from its D of 1024."""
        return self.vision_num_heads * self.vision_head_dim

    @property
    def merged_width(self) -> int:
        """Projector input width: the k*k merged sub-patch vectors concatenated."""
        return self.vision_merge_kernel_size ** 2 * self.vision_hidden_size

    @property
    def projector_hidden(self) -> int:
        return self.vision_projector_hidden_size or self.merged_width


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    kda_impl: str = _f("auto", "KDA core: auto (chunked on every platform) | reference | chunked | pallas_tpu | tokamax "
                       "(tokamax's KDA with the bounded gate fused in: its Mosaic kernels when the platform is TPU, its "
                       "xla_chunked path elsewhere; needs kda_gate=bounded and kda_chunk_size=64)",
                       ("auto", "reference", "chunked", "pallas_tpu", "tokamax"))
    kda_chunk_size: int = _f(64, "KDA chunk length of the chunked / pallas_tpu cores (a power of two >= 16)")
    kda_tokamax_max_segments: int = _f(16, "kda_impl=tokamax: most documents in one row (tokamax pads each to 64 "
                                       "tokens: T + 63 x this tokens of work); a row with more makes the KDA output "
                                       "NaN")
    attention_impl: str = _f("auto", "MLA prefill attention: auto (jnp on CPU, blocked on TPU, cudnn on GPU where it "
                             "fits, else blocked) | jnp | blocked (query blocks of 512, O(T) memory; use at pod scale) | "
                             "tokamax | cudnn (jax.nn.dot_product_attention's cuDNN flash kernel; GPU, bf16/fp16)",
                             ("auto", "jnp", "blocked", "tokamax", "cudnn"))
    moe_impl: str = _f("auto", "grouped matmul: auto (blocked on CPU, ragged_dot on TPU/GPU) | ragged_dot (TPU, GPU) | "
                       "megablox (Pallas TPU) | blocked (a scan over row blocks: the CPU one, where ragged_dot runs "
                       "every expert on every row) | dense (reference) | tokamax_ragged_dot (tokamax.ragged_dot: "
                       "Mosaic kernel on TPU, XLA elsewhere; no mxfp4 experts)",
                       ("auto", "ragged_dot", "megablox", "blocked", "dense", "tokamax_ragged_dot"))
    moe_mode: str = _f("dropless", "dropless | capacity", ("dropless", "capacity"))
    moe_gather_max_tokens: int = _f(64, "dropless MoE with at most this many tokens (decode, short prefills) gathers the chosen experts (4*N*top_k <= experts) or runs them one-hot, or with moe_impl=blocked loops over the used expert blocks (N*top_k <= 4*experts), instead of sort + ragged matmul; with moe_impl=blocked and experts <= 2*top_k one-hot at any token count; 0 = off")
    capacity_factor: float = _f(1.25, "expert capacity factor (capacity mode)")
    moe_ep_transport: str = _f("auto", "expert-parallel token exchange: auto (padded on CPU, ragged on TPU/GPU) | ragged (ragged_all_to_all; TPU/GPU) | padded (fixed-size all-to-all emulation; CPU)", ("auto", "ragged", "padded"))
    pallas_interpret: bool = _f(False, "run Pallas kernels in interpret mode (CPU tests)")
    context_parallel_strategy: str = _f("allgather", "KDA state combine across context shards: allgather | ring",
                                        ("allgather", "ring"))
    context_parallel_load_balance: bool = _f(True, "MLA under context parallelism: zigzag the query halves over the "
                                             "context shards so each does the same causal work (two ppermutes each "
                                             "way); false keeps each shard's own queries (the last shard then does "
                                             "about twice the balanced work)")
    loss_chunk_size: int = _f(1024, "sequence positions per chunk of the memory-light cross-entropy (all local rows at once)")
    loss_impl: str = _f("auto", "training cross-entropy: auto (chunked_fused on CPU, chunked on TPU/GPU) | chunked "
                        "(ours, loss_chunk_size positions at a time, recomputed in the backward) | chunked_fused (the "
                        "gradient computed in the forward: 3 lm-head matmuls per chunk instead of 4; keeps the head's "
                        "f32 gradient through the backward, so for small heads per device, not a pod's K3 head; "
                        "chunks capped at hidden_size / rows positions) | tokamax (fused lm head + CE: "
                        "Mosaic kernel on TPU, its chunked XLA loop elsewhere; no z-loss, no train accuracy) | "
                        "vocab_parallel (ours under shard_map: the lm head's vocabulary split over mesh axes, "
                        "never gathered)", ("auto", "chunked", "chunked_fused", "tokamax", "vocab_parallel"))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = _f(300, "optimizer steps")
    per_device_batch_size: float = _f(2, "sequences per device per step; under context parallelism each device holds its slice of them (global batch = this x devices / context; fractions allowed when < 1 device row)")
    max_target_length: int = _f(64, "sequence length")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step")
    learning_rate: float = _f(3e-3, "peak learning rate")
    lr_schedule: str = _f("wsd", "wsd | cosine | constant", ("wsd", "cosine", "constant"))
    warmup_steps_fraction: float = _f(0.05, "fraction of steps spent warming up")
    lr_decay_fraction: float = _f(0.2, "WSD: fraction of steps spent decaying to lr_final_fraction")
    lr_final_fraction: float = _f(0.1, "final lr as a fraction of the peak")
    opt_type: str = _f("muon", "muon | adamw", ("muon", "adamw"))
    muon_consistent_rms: Optional[float] = _f(0.2, "Muon update RMS matching AdamW (Moonlight); null = off")
    muon_weight_decay: float = _f(0.1, "decoupled weight decay of Muon leaves")
    muon_ns_dtype: str = _f("float32", "dtype of Muon's Newton-Schulz iterations (the Frobenius scaling and the update "
                            "stay float32): float32 | bfloat16 (as Keller Jordan's and Moonlight's Muon)",
                            ("float32", "bfloat16"))
    adam_weight_decay: float = _f(0.1, "decoupled weight decay of AdamW leaves")
    adam_b1: float = _f(0.9, "AdamW beta1")
    adam_b2: float = _f(0.95, "AdamW beta2")
    adam_eps: float = _f(1e-8, "AdamW eps")
    mu_dtype: str = _f("float32", "dtype of optimizer moments", ("float32", "bfloat16"))
    use_qk_clip: bool = _f(True, "MuonClip: rescale MLA q/k heads whose max logit exceeds the threshold")
    qk_clip_threshold: float = _f(100.0, "QK-clip max-logit threshold tau")
    gradient_clipping_threshold: float = _f(1.0, "global-norm gradient clip; 0 = off")
    z_loss_weight: float = _f(0.0, "weight of the log(Z)^2 auxiliary loss")
    router_bias_update_rate: float = _f(1e-3, "aux-loss-free bias update rate; 0 = frozen")
    moe_aux_loss_coef: float = _f(0.0, "sequence-level balance loss weight")
    nan_policy: str = _f("stop", "non-finite loss: stop (keep last good checkpoint) | skip the step", ("stop", "skip"))
    freeze: list = _f([], "modules kept frozen: any of embed, attention, kda, mla, moe, experts, router, norms, lm_head, "
                      "attn_res (text groups: never the vision side), vision (the tower), projector")
    seed: int = _f(0, "parameter-init and dropout seed")
    dtype: str = _f("float32", "activation dtype", ("float32", "bfloat16"))
    weight_dtype: str = _f("float32", "parameter dtype", ("float32", "bfloat16"))
    remat_policy: str = _f("full", "none | full | save_dot | save_mixer_out | offload_mixer_out (mixer_out to pinned host "
                           "memory) | offload_kda (mixer_out and the KDA recurrence's output and chunk states to host: "
                           "the backward skips the recurrence) | custom (remat_save_names, remat_offload_names); offload "
                           "needs a TPU or GPU (docs/running-on-tpu-pods.md)",
                           ("none", "full", "save_dot", "save_mixer_out", "offload_mixer_out", "offload_kda", "custom"))
    remat_save_names: list = _f([], "remat_policy=custom: tensors kept on device for the backward, of mixer_out, ffn_out, "
                                "kda_core_out, kda_chunk_states (k3jax.remat.NAMES); the rest are recomputed")
    remat_offload_names: list = _f([], "remat_policy=custom: tensors offloaded to pinned host memory in the forward and "
                                   "read back in the backward (same names as remat_save_names)")
    scan_layers: bool = _f(True, "scan the repeating layer period (False unrolls, for debugging)")
    num_pipeline_microbatches: int = _f(-1, "pipeline (stage > 1): microbatches each step streams through the stages, a multiple of the stage count; -1 = the stage count")
    pipeline_attn_res_cache: bool = _f(True, "pipeline (stage > 1), AttnRes models: a stage hand-off carries the partial sum and the newest AttnRes blocks a stage has not seen (K3 at 2 stages: 1), each stage keeping every microbatch's block buffer, instead of the whole buffer (K3: 2x the hidden state per hop instead of 9x; docs/sharding.md)")
    pipeline_fsdp_ag_once: bool = _f(False, "pipeline (stage > 1): all-gather a stage's fsdp-sharded period weights once per step, before the schedule, instead of once per microbatch and repeat (holds the stage's weights and their gradients unsharded over fsdp/context; docs/sharding.md)")
    attn_res_segment_scan: bool = _f(False, "AttnRes: scan the periods block by block (the backward keeps the block buffer once per AttnRes block, not once per period, but on the K3 v5p-2048 compile it took 5.8 GiB more per device in all; docs/architecture.md); false = one flat scan")
    log_period: int = _f(10, "steps between log lines")
    peak_tflops: Optional[float] = _f(None, "peak TFLOP/s per device for MFU; null = known table or a CPU measurement")
    enable_tensorboard: bool = _f(True, "write TensorBoard scalars")
    profiler: str = _f("", "'' = off | xplane: a jax.profiler trace of profiler_steps steps into <run dir>/profile", ("", "xplane"))
    skip_first_n_steps_for_profiler: int = _f(1, "profiler: steps of this run before the trace starts (the first step waits for compilation and input)")
    profiler_steps: int = _f(5, "profiler: steps traced")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    dataset_type: str = _f("synthetic", "synthetic | jsonl | parquet | arrayrecord | sft | mm_sft (image conversations, LLaVA / MindSpeed-MM layout; docs/data.md)", ("synthetic", "jsonl", "parquet", "arrayrecord", "sft", "mm_sft"))
    dataset_path: Optional[str] = _f(None, "glob of data files (not needed for synthetic)")
    tokenizer_path: Optional[str] = _f(None, "Kimi tokenizer directory (tiktoken.model + tokenizer_config.json); null = the one recorded with load_parameters_path (<run>/tokenizer, or beside a converter output's params); a training run records its own there")
    data_shuffle: bool = _f(True, "shuffle records")
    data_seed: int = _f(42, "data order seed")
    bad_data: str = _f("skip", "malformed records: skip (counted, warned) | fatal", ("skip", "fatal"))
    text_key: str = _f("text", "JSON/Parquet field holding the text")
    bad_data_check_records: int = _f(100, "records of each data source read and checked before the model is built (0 = no early check); also the count after which bad_data_max_fraction applies while training")
    bad_data_max_fraction: float = _f(0.5, "stop when more than this fraction of the records read are malformed (skip policy)")
    # Supervised fine-tuning (dataset_type=sft; see docs/fine-tuning.md)
    sft_format: str = _f("messages", "SFT record layout: messages ({\"messages\": [{role, content}, ...]}) | hellaswag ({ctx, endings, label})", ("messages", "hellaswag"))
    sft_default_system_prompt: bool = _f(True, "SFT: give conversations without a system message Kimi's default one, as the chat template does at inference")
    sft_overlong: str = _f("truncate", "SFT conversation longer than max_target_length: truncate (keep the prompt, cut the end) | drop (counted)", ("truncate", "drop"))
    num_epoch: int = _f(0, "passes over the training data; training stops early when they are used up (0 = repeat until steps)")
    image_root: Optional[str] = _f(None, "mm_sft: directory (local or gs://) that relative image paths are read from; null = the directory of each JSON file")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    eval_dataset_path: Optional[str] = _f(None, "glob of evaluation files read like the training data (dataset_type, tokenizer, sft_format); null = no evaluation")
    eval_interval: int = _f(100, "steps between evaluations (one also runs after the last step)")
    eval_steps: int = _f(10, "batches per evaluation, the same batches every time; -1 = one pass over the evaluation files")
    eval_per_device_batch_size: float = _f(0.0, "evaluation sequences per device, counted as per_device_batch_size is; 0 = per_device_batch_size")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    base_output_directory: str = _f("runs", "root of run directories")
    run_name: str = _f("tiny", "run directory name under base_output_directory")
    enable_checkpointing: bool = _f(True, "save checkpoints")
    checkpoint_period: int = _f(100, "steps between checkpoints (the last step is always saved)")
    max_checkpoints_to_keep: int = _f(3, "keep the last K checkpoints")
    async_checkpointing: bool = _f(True, "save in the background")
    load_parameters_path: Optional[str] = _f(None, "start from these parameters (a checkpoint step dir, a run dir or a converter output)")
    allow_missing_router_biases: bool = _f(False, "accept a load_parameters_path without router biases (its 'extra' item) and start them at zero")


# The device mesh's axes, in mesh order; MeshConfig has an ici_/dcn_<axis>_parallelism key for each.
# k3jax.sharding maps the logical axis names of arrays onto them.
MESH_AXES = ("data", "fsdp", "context", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    ici_data_parallelism: int = _f(1, "data axis within a slice")
    ici_fsdp_parallelism: int = _f(-1, "fsdp axis within a slice; -1 fills the remaining devices")
    ici_context_parallelism: int = _f(1, "context axis within a slice: splits every sequence into contiguous slices")
    ici_expert_parallelism: int = _f(1, "expert axis within a slice")
    ici_tensor_parallelism: int = _f(1, "tensor axis within a slice")
    dcn_data_parallelism: int = _f(1, "data axis across slices")
    dcn_fsdp_parallelism: int = _f(1, "fsdp axis across slices")
    dcn_context_parallelism: int = _f(1, "context axis across slices")
    dcn_expert_parallelism: int = _f(1, "expert axis across slices")
    dcn_tensor_parallelism: int = _f(1, "tensor axis across slices")
    ici_stage_parallelism: int = _f(1, "stage axis within a slice: pipeline stages over the scanned layer periods (the outermost mesh axis, added only when > 1; docs/sharding.md); 1 = no pipeline")
    dcn_stage_parallelism: int = _f(1, "stage axis across slices (pipeline stages)")
    shard_params_over_all_axes: bool = _f(True, "also split non-expert weights over the fsdp/expert axes their rules leave "
                                          "unused (training memory); false for serving meshes: replicated over expert, "
                                          "tensor-split only, so decode never all-gathers them")
    enable_distributed: bool = _f(False, "join a multi-process job with jax.distributed.initialize() before anything touches a device (multi-host TPU VMs, GKE, scripts/local_pod.sh)")
    coordinator_address: Optional[str] = _f(None, "multi-host: host:port of process 0's coordinator; null = JAX's auto-detection (TPU VMs, GKE)")
    num_processes: Optional[int] = _f(None, "multi-host: number of processes in the job; null = auto-detected")
    process_id: Optional[int] = _f(None, "multi-host: this process's index in 0..num_processes-1; null = auto-detected")
    jax_distributed_initialization_timeout: int = _f(300, "multi-host: seconds to wait for every process to join the coordinator")
    jax_cache_dir: Optional[str] = _f(None, "persistent compilation cache directory (local or gs://), so a restart does not recompile; null = off (or JAX_COMPILATION_CACHE_DIR)")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    prompt: str = _f("I love to", "text to continue")
    max_new_tokens: int = _f(32, "tokens to generate per prompt")
    max_prefill_length: int = _f(0, "prompt budget; 0 = max_target_length")
    sampling: str = _f("greedy", "greedy | sample", ("greedy", "sample"))
    temperature: float = _f(1.0, "softmax temperature (sample)")
    top_k: int = _f(0, "keep the k most likely tokens; 0 = off")
    top_p: float = _f(1.0, "nucleus probability mass; 1 = off")
    decode_seed: int = _f(0, "sampling seed")
    chat: bool = _f(False, "wrap the prompt in the Kimi chat template")
    stream: bool = _f(True, "print tokens as they are produced")
    images: list = _f([], "decode: image files (local or gs://) shown before the prompt; needs vision_enabled=true")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    serve_host: str = _f("127.0.0.1", "serve: address to listen on (0.0.0.0 = every interface)")
    serve_port: int = _f(8000, "serve: TCP port of the OpenAI-compatible HTTP API")
    serve_max_batch: int = _f(8, "serve: decode slots (requests generating at once); each holds a cache of max_target_length tokens")
    serve_max_queue: int = _f(64, "serve: requests waiting for a slot; more get HTTP 429")
    serve_prefill_chunk: int = _f(256, "serve: prompt tokens prefilled per step between decode steps (compiled chunk sizes: powers of two from 32 up to it)")
    serve_prefill_batch: int = _f(8, "serve: prompts prefilled together in one step, a chunk of each (compiled for powers of two from 2 up to it, capped at serve_max_batch); 1 = one prompt per step")
    serve_decode_steps: int = _f(4, "serve: decode steps run as one program while no prompt waits to prefill (tokens stream in groups of it; a new request waits at most that many steps); 1 = one step per program")
    serve_max_decode_wait: int = _f(4, "serve: prefill steps in a row the generating requests may wait while a burst of prompts prefills (their decode steps join up); 0 = a decode step after every prefill step")
    serve_api_key: Optional[str] = _f(None, "serve: bearer token every /v1 request must carry; null = no key")
    serve_decode_buckets: list = _f([], "serve: decode batch sizes compiled at start; each step runs the smallest that holds the generating slots; [] = powers of two up to serve_max_batch, and it")
    serve_prefix_block: int = _f(0, "serve: prefix cache block in tokens (MLA rows kept per block); a multiple of serve_prefill_chunk; 0 = serve_prefill_chunk")
    serve_prefix_cache_bytes: int = _f(1 << 30, "serve: bytes of cached prompt prefixes (MLA blocks + KDA snapshots), LRU-evicted; 0 = off")
    serve_image_url_domains: list = _f([], "serve: hosts whose http(s) image_url parts the server fetches (exact names, or .example.com for its subdomains); [] = none (base64 data: URIs only)")
    serve_image_max_bytes: int = _f(20 << 20, "serve: largest image one image_url part may carry (data: URI decoded or fetched), in bytes")
    serve_image_fetch_timeout_s: float = _f(10.0, "serve: seconds an http(s) image fetch may take, connection to last byte")


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    golden: Optional[str] = _f(None, "logit_check: .npz with tokens [B,T] and reference logits [B,T,V]")
    max_kl: float = _f(0.01, "logit_check: fail when the max per-token KL divergence exceeds this")
    atol: float = _f(1.0, "logit_check: fail when the max absolute logit error exceeds this")


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    compile_topology: Optional[str] = _f(None, "compile: TPU topology to compile for, e.g. v5p-2048, tpu7x-1024, v5p:2x2x1")
    compile_topology_num_slices: int = _f(1, "compile: slices of compile_topology joined over DCN (multi-slice); the dcn_*_parallelism product must equal it")
    compile_step: str = _f("both", "compile: train | decode | both (train and decode) | prefill (the prompt forward "
                           "of max_target_length tokens per row into its cache) | serve (the inference core's programs "
                           "at the serve_* config: the largest decode bucket and prefill chunk)",
                           ("train", "decode", "both", "prefill", "serve"))
    compile_dump_dir: Optional[str] = _f(None, "compile: have the compiler write its optimised HLO, buffer assignment and "
                                         "memory-usage report (the largest live buffers at the peak) under this directory")
    compile_images_per_sequence: int = _f(0, "compile: train step of a vision model with this many square images in "
                                          "each sequence (media grouped per row); 0 = text only")
    compile_image_size: int = _f(1024, "compile: side in pixels of those images (the processor's resize rule gives the grid)")
    topology: Optional[str] = _f(None, "plan: TPU topology whose meshes to try")
    plan_expert_parallelism: list = _f([], "plan: expert parallelism sizes to try ([] = the three largest dividing num_experts and the devices)")
    plan_data_parallelism: list = _f([1, 2], "plan: data parallelism sizes to try")
    plan_context_parallelism: list = _f([1], "plan: context parallelism sizes to try (sequence slices; sizes not dividing the devices or max_target_length are skipped)")
    plan_remat_policies: list = _f(["full", "save_mixer_out"], "plan: remat policies to try")
    plan_batch_sizes: list = _f([1.0, 2.0], "plan: per-device batch sizes to try")
    plan_dcn_axes: list = _f(["data", "stage"], "plan: with compile_topology_num_slices > 1, the mesh axes to try across "
                             "the slices (data, fsdp, expert, stage; each candidate puts every slice on one), or a pair "
                             "such as stage*fsdp splitting them (4 slices: 2 x 2); each entry is one more full "
                             "compile per in-slice candidate")
    plan_step: str = _f("train", "plan: which step ranks the meshes: train (fsdp x expert x data, tokens/s/chip) | decode "
                        "(serving meshes tensor x expert, roofline ms per token)", ("train", "decode"))


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """GRPO-family reinforcement learning (docs/rl.md). Names follow Tunix's GRPOConfig with an rl_ prefix."""
    rl_num_generations: int = _f(4, "completions sampled per prompt (GRPOConfig.num_generations, the group size G); "
                                 "advantages are relative to the group, so >= 2")
    rl_num_iterations: int = _f(1, "optimizer steps per rollout batch (GRPOConfig.num_iterations); 1 = on-policy: "
                                "pi_old is the policy being trained and its log-probs need no extra forward")
    rl_beta: float = _f(0.0, "weight of the k3 KL estimate to a frozen reference (GRPOConfig.beta); 0 = no KL term "
                        "and no reference copy of the parameters")
    rl_epsilon: float = _f(0.2, "lower clip of the importance ratio: clip(ratio, 1 - rl_epsilon, ...) (GRPOConfig.epsilon; "
                           "GSPO's paper: 3e-4)")
    rl_epsilon_high: float = _f(0.28, "upper clip: clip(ratio, ..., 1 + rl_epsilon_high) (DAPO's clip-higher 0.28; "
                                "= rl_epsilon for GRPO's symmetric clip; GSPO's paper: 4e-4)")
    rl_loss_agg: str = _f("token_mean", "how token losses become the loss: token_mean (over every completion token "
                          "of the batch, DAPO) | seq_mean_token_mean (per sequence, then over sequences: GRPO as "
                          "published, GSPO) | seq_mean_token_sum_norm (token sums over a constant, the row length "
                          "T: Dr. GRPO)", ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"))
    rl_advantage: str = _f("grpo", "group advantage: grpo ((r - mean) / (std + 1e-4)) | dr_grpo (r - mean, no std)",
                           ("grpo", "dr_grpo"))
    rl_objective: str = _f("grpo", "ratio: grpo (per token) | gspo (per sequence, length-normalised) | gspo_token "
                           "(GSPO's value with per-token gradients)", ("grpo", "gspo", "gspo_token"))
    rl_drop_equal_groups: bool = _f(True, "leave groups whose rewards are all equal (advantage 0, no signal) out of "
                                    "the loss and its normaliser, as DAPO's dynamic-sampling filter does")
    rl_tis_cap: float = _f(2.0, "truncated importance sampling: weight each token's loss by min(pi_old / pi_rollout, "
                           "this) against the rollout / trainer mismatch; 0 = off")
    rl_rewards: list = _f(["exact_match"], "rewards summed with weights: NAME or module:function, optionally =WEIGHT "
                          "(default 1), e.g. [exact_match, format=0.1, my_pkg.rewards:score=0.5]; built in: "
                          "exact_match, tool_call, format")
    rl_reward_errors: str = _f("raise", "a reward function that raises or returns no number: raise (stop, naming "
                               "the function and the prompt's file:line) | zero (that component scores 0, counted)",
                               ("raise", "zero"))
    rl_max_new_tokens: int = _f(16, "tokens a rollout may generate per model turn; a prompt plus these must fit "
                                "max_target_length")
    rl_max_turns: int = _f(1, "model turns per rollout (a turn ending in a tool call gets the tool's result and "
                           "continues); 1 = single-turn")
    rl_temperature: float = _f(1.0, "rollout sampling temperature (> 0: the behaviour log-probs are of this "
                               "distribution)")
    rl_top_p: float = _f(1.0, "rollout nucleus probability mass; 1 = off (the behaviour log-probs are of the "
                         "truncated distribution)")
    rl_tools: list = _f([], "tools a rollout may call, name=module:function each (a dict of arguments goes in as "
                         "keywords; a failure or a timeout becomes the tool message); with rl_max_turns > 1")
    rl_tool_timeout_s: float = _f(10.0, "seconds a tool call may take before its message says it timed out")
    rl_shuffle_rewards: bool = _f(False, "a control for experiments, not for training: each group's rewards go to "
                                  "another prompt's group before the advantages (scale kept, link to the completions "
                                  "cut), so what is learnt without the reward's information can be measured")


SECTIONS = {"model": ModelConfig, "vision": VisionConfig, "kernel": KernelConfig, "train": TrainConfig, "data": DataConfig, "eval": EvalConfig,
            "checkpoint": CheckpointConfig, "mesh": MeshConfig, "decode": DecodeConfig, "serve": ServeConfig,
            "check": CheckConfig, "compile": CompileConfig, "rl": RLConfig}
TOP_LEVEL = ("model_name",)


@dataclasses.dataclass(frozen=True)
class Config:
    model_name: str
    model: ModelConfig
    vision: VisionConfig
    kernel: KernelConfig
    train: TrainConfig
    data: DataConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    mesh: MeshConfig
    decode: DecodeConfig
    serve: ServeConfig
    check: CheckConfig
    compile: CompileConfig
    rl: RLConfig

    def flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model_name": self.model_name}
        for name in SECTIONS:
            out.update(dataclasses.asdict(getattr(self, name)))
        return out

    @property
    def run_dir(self) -> Path:
        return Path(self.checkpoint.base_output_directory) / self.checkpoint.run_name

    def context_size(self, num_devices: int) -> int:
        """Devices that hold slices of the same rows (ici x dcn context parallelism; an ici size of -1
        is the share of ``num_devices`` the other axes leave, as in ``config.mesh_shape``)."""
        m = self.mesh
        dcn = m.dcn_context_parallelism
        ici = m.ici_context_parallelism
        if ici == -1:
            others = 1
            for a in ("stage",) + MESH_AXES:
                others *= getattr(m, f"dcn_{a}_parallelism") * (getattr(m, f"ici_{a}_parallelism") if a != "context" else 1)
            ici = max(1, num_devices // others)
        return ici * dcn

    def global_batch_size(self, num_devices: int, per_device: float | None = None) -> int:
        """Rows of the global batch: ``per_device`` (default per_device_batch_size) rows per device of
        one context slice. The devices of a context group hold slices of the SAME rows, so the rows
        are per_device x devices / context (with context=1, per_device x devices); each device holds
        per_device rows of max_target_length / context tokens."""
        pdb = self.train.per_device_batch_size if per_device is None else per_device
        return max(1, int(round(pdb * num_devices / self.context_size(num_devices))))
