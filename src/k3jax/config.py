"""Typed configuration: one frozen dataclass tree, one entry syntax.

    python -m k3jax.<tool> configs/base.yml model_name=kimi-k3 key=value ...

Merge order: base.yml < model yml (``model_name``: a name under ``configs/models/`` or a path to a
``.yml``) < command line. Keys are flat and globally unique (MaxText style); each belongs to one
section dataclass, and modules receive their section (``cfg.model``, ``cfg.train``, ...). Every
value is type-checked and coerced from strings. Errors a user can act on are ``ConfigError``s with
one-line messages; ``main`` entry points print them without a traceback.

Derived quantities (global batch, layer schedule, AttnRes blocks, parameter counts, FLOPs per token)
are methods here or in ``k3jax.counts``, computed from the config alone.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Optional

import yaml

from k3jax.errors import UserError, guard, usage, wants_help

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


class ConfigError(UserError, ValueError):
    """A configuration problem the user can fix; the message is one actionable line."""


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
class KernelConfig:
    kda_impl: str = _f("chunked", "KDA core: reference | chunked | pallas_tpu", ("reference", "chunked", "pallas_tpu"))
    kda_chunk_size: int = _f(64, "KDA chunk length of the chunked / pallas_tpu cores (a power of two >= 16)")
    attention_impl: str = _f("jnp", "MLA prefill attention: jnp | blocked (query blocks of 512, O(T) memory; use at "
                             "pod scale) | tokamax", ("jnp", "blocked", "tokamax"))
    moe_impl: str = _f("ragged_dot", "grouped matmul: ragged_dot | megablox | dense", ("ragged_dot", "megablox", "dense"))
    moe_mode: str = _f("dropless", "dropless | capacity", ("dropless", "capacity"))
    moe_gather_max_tokens: int = _f(64, "dropless MoE with at most this many tokens (decode, short prefills) gathers the chosen experts (4*N*top_k <= experts) or runs them one-hot, instead of sort + ragged matmul; 0 = off")
    capacity_factor: float = _f(1.25, "expert capacity factor (capacity mode)")
    moe_ep_transport: str = _f("ragged", "expert-parallel token exchange: ragged (ragged_all_to_all; TPU/GPU) | padded (fixed-size all-to-all emulation; CPU)", ("ragged", "padded"))
    pallas_interpret: bool = _f(False, "run Pallas kernels in interpret mode (CPU tests)")
    context_parallel_strategy: str = _f("allgather", "KDA state combine across context shards: allgather | ring",
                                        ("allgather", "ring"))
    loss_chunk_size: int = _f(1024, "sequence positions per chunk of the memory-light cross-entropy (all local rows at once)")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = _f(300, "optimizer steps")
    per_device_batch_size: float = _f(2, "sequences per device per step (fractions allowed when < 1 device row)")
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
    freeze: list = _f([], "modules kept frozen: any of embed, attention, kda, mla, moe, experts, router, norms, lm_head")
    seed: int = _f(0, "parameter-init and dropout seed")
    dtype: str = _f("float32", "activation dtype", ("float32", "bfloat16"))
    weight_dtype: str = _f("float32", "parameter dtype", ("float32", "bfloat16"))
    remat_policy: str = _f("full", "none | full | save_dot | save_mixer_out", ("none", "full", "save_dot", "save_mixer_out"))
    scan_layers: bool = _f(True, "scan the repeating layer period (False unrolls, for debugging)")
    log_period: int = _f(10, "steps between log lines")
    peak_tflops: Optional[float] = _f(None, "peak TFLOP/s per device for MFU; null = known table or a CPU measurement")
    enable_tensorboard: bool = _f(True, "write TensorBoard scalars")
    profiler: str = _f("", "'' = off | xplane: a jax.profiler trace of profiler_steps steps into <run dir>/profile", ("", "xplane"))
    skip_first_n_steps_for_profiler: int = _f(1, "profiler: steps of this run before the trace starts (the first step waits for compilation and input)")
    profiler_steps: int = _f(5, "profiler: steps traced")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    dataset_type: str = _f("synthetic", "synthetic | jsonl | parquet | arrayrecord | sft", ("synthetic", "jsonl", "parquet", "arrayrecord", "sft"))
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


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    eval_dataset_path: Optional[str] = _f(None, "glob of evaluation files read like the training data (dataset_type, tokenizer, sft_format); null = no evaluation")
    eval_interval: int = _f(100, "steps between evaluations (one also runs after the last step)")
    eval_steps: int = _f(10, "batches per evaluation, the same batches every time; -1 = one pass over the evaluation files")
    eval_per_device_batch_size: float = _f(0.0, "evaluation sequences per device; 0 = per_device_batch_size")


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


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    serve_host: str = _f("127.0.0.1", "serve: address to listen on (0.0.0.0 = every interface)")
    serve_port: int = _f(8000, "serve: TCP port of the OpenAI-compatible HTTP API")
    serve_max_batch: int = _f(8, "serve: decode slots (requests generating at once); each holds a cache of max_target_length tokens")
    serve_max_queue: int = _f(64, "serve: requests waiting for a slot; more get HTTP 429")
    serve_prefill_chunk: int = _f(256, "serve: prompt tokens prefilled per step between decode steps (compiled chunk sizes: powers of two from 32 up to it)")
    serve_api_key: Optional[str] = _f(None, "serve: bearer token every /v1 request must carry; null = no key")


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    golden: Optional[str] = _f(None, "logit_check: .npz with tokens [B,T] and reference logits [B,T,V]")
    max_kl: float = _f(0.01, "logit_check: fail when the max per-token KL divergence exceeds this")
    atol: float = _f(1.0, "logit_check: fail when the max absolute logit error exceeds this")


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    compile_topology: Optional[str] = _f(None, "compile: TPU topology to compile for, e.g. v5p-2048, tpu7x-1024, v5p:2x2x1")
    compile_topology_num_slices: int = _f(1, "compile: slices of compile_topology joined over DCN (multi-slice); the dcn_*_parallelism product must equal it")
    compile_step: str = _f("both", "compile: train | decode | both", ("train", "decode", "both"))
    topology: Optional[str] = _f(None, "plan: TPU topology whose meshes to try")
    plan_expert_parallelism: list = _f([], "plan: expert parallelism sizes to try ([] = the three largest dividing num_experts and the devices)")
    plan_data_parallelism: list = _f([1, 2], "plan: data parallelism sizes to try")
    plan_remat_policies: list = _f(["full", "save_mixer_out"], "plan: remat policies to try")
    plan_batch_sizes: list = _f([1.0, 2.0], "plan: per-device batch sizes to try")
    plan_step: str = _f("train", "plan: which step ranks the meshes: train (fsdp x expert x data, tokens/s/chip) | decode "
                        "(serving meshes tensor x expert, roofline ms per token)", ("train", "decode"))


SECTIONS = {"model": ModelConfig, "kernel": KernelConfig, "train": TrainConfig, "data": DataConfig, "eval": EvalConfig,
            "checkpoint": CheckpointConfig, "mesh": MeshConfig, "decode": DecodeConfig, "serve": ServeConfig,
            "check": CheckConfig, "compile": CompileConfig}
TOP_LEVEL = ("model_name",)


@dataclasses.dataclass(frozen=True)
class Config:
    model_name: str
    model: ModelConfig
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

    def flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model_name": self.model_name}
        for name in SECTIONS:
            out.update(dataclasses.asdict(getattr(self, name)))
        return out

    @property
    def run_dir(self) -> Path:
        return Path(self.checkpoint.base_output_directory) / self.checkpoint.run_name

    def global_batch_size(self, num_devices: int) -> int:
        return max(1, int(round(self.train.per_device_batch_size * num_devices)))


def _key_index() -> dict[str, tuple[str, dataclasses.Field]]:
    idx = {}
    for sec, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in idx, f"duplicate config key {f.name}"
            idx[f.name] = (sec, f)
    return idx


KEYS = _key_index()


def all_keys() -> list[str]:
    return list(TOP_LEVEL) + list(KEYS)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def coerce(key: str, value: Any) -> Any:
    """Coerce ``value`` (a YAML value or a command-line string) to the declared type of ``key``."""
    sec, f = KEYS[key]
    tp = typing.get_type_hints(SECTIONS[sec])[key]
    if isinstance(value, str) and tp is not str:
        try:
            value = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            raise ConfigError(f"{key}={value!r}: cannot parse the value") from None
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)
    base = next((a for a in typing.get_args(tp) if a is not type(None)), tp) if optional else tp
    if value is None or (isinstance(value, str) and value.lower() in ("null", "none") and base is not str):
        if optional:
            return None
        raise ConfigError(f"{key}: null is not allowed (expected {_type_name(base)})")
    ok = True
    if base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif base is str:
        value = value if isinstance(value, str) else str(value)
    elif base is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        ok = isinstance(value, list)
        value = list(value) if ok else value
    if not ok:
        raise ConfigError(f"{key}={value!r}: expected {_type_name(base)}, got {type(value).__name__}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{key}={value!r}: must be one of {', '.join(choices)}")
    return value


# MaxText's names for keys users type every day. They are read as the k3jax key with a one-line
# notice (so a MaxText command line works and says what it became); giving both names in one place
# is an error, since which one should win is a guess. Saved configs use the k3jax names only.
ALIASES = {
    "max_num_checkpoints_to_keep": "max_checkpoints_to_keep",
    "max_prefill_predict_length": "max_prefill_length",
    "decode_sampling_strategy": "sampling",
    "decode_sampling_temperature": "temperature",
    "decode_sampling_top_k": "top_k",
    "decode_sampling_nucleus_p": "top_p",
    "z_loss_multiplier": "z_loss_weight",
    "learning_rate_final_fraction": "lr_final_fraction",
    "num_experts_per_tok": "num_experts_per_token",
    "data_shuffle_seed": "data_seed",
}
# MaxText's decode_sampling_strategy values: every strategy but greedy samples; which tokens are
# eligible is then set by top_k / top_p (decode_sampling_top_k / decode_sampling_nucleus_p).
MAXTEXT_SAMPLING = {"greedy": "greedy", "weighted": "sample", "nucleus": "sample", "topk": "sample",
                    "composite": "sample"}


def canonical_keys(values: dict, where: str) -> dict:
    """``values`` with MaxText aliases renamed to k3jax keys (order kept), one notice per alias on
    stderr; ConfigError when an alias and its k3jax key are both given in ``where``."""
    import sys
    out = {}
    for key, val in values.items():
        canon = ALIASES.get(key)
        if canon is None:
            out[key] = val
            continue
        if canon in values:
            raise ConfigError(f"both '{key}' (MaxText's name) and '{canon}' are set ({where}); keep one of them")
        if key == "decode_sampling_strategy":
            if str(val) not in MAXTEXT_SAMPLING:
                raise ConfigError(f"decode_sampling_strategy={val!r}: must be one of {', '.join(MAXTEXT_SAMPLING)}")
            val = MAXTEXT_SAMPLING[str(val)]
        print(f"note: '{key}' is MaxText's name for '{canon}'; read as {canon}={val}", file=sys.stderr)
        out[canon] = val
    return out


def _unknown(key: str, where: str) -> ConfigError:
    near = difflib.get_close_matches(key, all_keys() + list(ALIASES), n=1, cutoff=0.5)
    hint = f"; did you mean '{near[0]}'?" if near else "; run `python -m k3jax.config configs/base.yml` to list keys"
    return ConfigError(f"unknown config key '{key}' ({where}){hint}")


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of key: value")
    return data


def available_models() -> list[str]:
    return sorted(p.stem for p in (REPO_CONFIGS / "models").glob("*.yml"))


def resolve_model_path(model_name: str, base_dir: Path) -> Path:
    if model_name.endswith((".yml", ".yaml")) or os.sep in model_name:
        p = Path(model_name)
        if p.is_dir():
            p = p / "model.yml"
        if not p.exists():
            raise ConfigError(f"model_name={model_name}: file not found")
        return p
    for root in (base_dir / "models", REPO_CONFIGS / "models"):
        if (root / f"{model_name}.yml").exists():
            return root / f"{model_name}.yml"
    raise ConfigError(f"unknown model_name '{model_name}'; available: {', '.join(available_models())}")


def parse_overrides(args: list[str]) -> dict[str, str]:
    out = {}
    for a in args:
        if "=" not in a:
            raise ConfigError(f"argument '{a}' is not key=value")
        k, v = a.split("=", 1)
        out[k.strip().lstrip("-")] = v
    return out


def load(base: str | Path = REPO_CONFIGS / "base.yml", overrides: list[str] | dict | None = None) -> Config:
    """Load base.yml, then the model yml named by ``model_name``, then ``overrides``; validate."""
    base = Path(base)
    cli = parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides or {})
    cli = canonical_keys(cli, "command line")
    values: dict[str, Any] = {}
    for k, v in canonical_keys(_read_yaml(base), str(base)).items():
        if k not in KEYS and k not in TOP_LEVEL:
            raise _unknown(k, str(base))
        values[k] = v
    model_name = str(cli.get("model_name", values.get("model_name", "default")))
    if model_name not in ("", "default"):
        mpath = resolve_model_path(model_name, base.parent)
        for k, v in canonical_keys(_read_yaml(mpath), str(mpath)).items():
            if k not in KEYS:
                raise _unknown(k, str(mpath))
            values[k] = v
    for k, v in cli.items():
        if k not in KEYS and k not in TOP_LEVEL:
            raise _unknown(k, "command line")
        values[k] = v
    values["model_name"] = model_name
    sections = {sec: {} for sec in SECTIONS}
    for k, v in values.items():
        if k in TOP_LEVEL:
            continue
        sections[KEYS[k][0]][k] = coerce(k, v)
    cfg = Config(model_name=model_name, **{s: SECTIONS[s](**kw) for s, kw in sections.items()})
    validate(cfg)
    return cfg


def override(cfg: Config, values: dict[str, Any]) -> Config:
    """``cfg`` with ``values`` ({key: value}; typed values or command-line strings) replaced and the
    result validated, as if they had been given on the command line (``model_name`` excepted)."""
    sections: dict[str, dict] = {}
    for key, val in canonical_keys(values, "override").items():
        if key not in KEYS:
            raise _unknown(key, "override")
        sections.setdefault(KEYS[key][0], {})[key] = coerce(key, val)
    out = dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **kw) for s, kw in sections.items()})
    validate(out)
    return out


def validate(cfg: Config, num_devices: int | None = None, platform: str | None = None) -> None:
    """Consistency checks that need no devices; ``num_devices`` adds the mesh checks and
    ``platform`` (the devices' platform, e.g. "cpu") the kernel-placement ones."""
    m, t, k = cfg.model, cfg.train, cfg.kernel
    positive = {"vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_layers": m.num_layers,
                "kda_num_heads": m.kda_num_heads, "kda_head_dim": m.kda_head_dim, "num_attention_heads":
                m.num_attention_heads, "num_experts_per_token": m.num_experts_per_token, "steps": t.steps,
                "max_target_length": t.max_target_length,
                "kda_chunk_size": k.kda_chunk_size, "attn_res_block_size": m.attn_res_block_size,
                "gradient_accumulation_steps": t.gradient_accumulation_steps}
    for name, v in positive.items():
        if v <= 0:
            raise ConfigError(f"{name}={v}: must be positive")
    if m.mla_every < 0:
        raise ConfigError(f"mla_every={m.mla_every}: must be >= 0")
    if t.per_device_batch_size <= 0:
        raise ConfigError(f"per_device_batch_size={t.per_device_batch_size}: must be positive")
    bad = [l for l in m.mla_extra_layers if not (isinstance(l, int) and 0 <= l < m.num_layers)]
    if bad:
        raise ConfigError(f"mla_extra_layers={m.mla_extra_layers}: layers {bad} are outside 0..{m.num_layers - 1} "
                          f"(the layer schedule must have num_layers={m.num_layers} entries)")
    if not 0 <= m.first_k_dense <= m.num_layers:
        raise ConfigError(f"first_k_dense={m.first_k_dense}: must be within 0..num_layers={m.num_layers}")
    if m.first_k_dense < m.num_layers:
        if m.num_experts_per_token > m.num_experts:
            raise ConfigError(f"num_experts_per_token={m.num_experts_per_token} exceeds num_experts={m.num_experts}")
        if m.num_experts % m.n_group or m.topk_group > m.n_group:
            raise ConfigError(f"n_group={m.n_group}, topk_group={m.topk_group}: n_group must divide num_experts="
                              f"{m.num_experts} and topk_group <= n_group")
    if m.experts_format == "mxfp4" and m.first_k_dense < m.num_layers:
        odd = {k: v for k, v in (("moe_intermediate_size", m.moe_intermediate_size),
                                 ("moe_latent_size" if m.moe_latent_size else "hidden_size", m.routed_width)) if v % 32}
        if odd:
            raise ConfigError(f"experts_format=mxfp4 needs the routed experts' input widths to be multiples of 32 "
                              f"(one E8M0 scale per 32 inputs); got {odd}")
    if m.attn_res and m.attn_res_block_size > m.num_layers:
        raise ConfigError(f"attn_res_block_size={m.attn_res_block_size} exceeds num_layers={m.num_layers}")
    if k.moe_gather_max_tokens < 0:
        raise ConfigError(f"moe_gather_max_tokens={k.moe_gather_max_tokens}: must be >= 0 (0 turns the few-token "
                          "MoE dispatch off)")
    if k.kda_chunk_size < 16 or k.kda_chunk_size & (k.kda_chunk_size - 1):
        raise ConfigError(f"kda_chunk_size={k.kda_chunk_size}: must be a power of two >= 16 (e.g. 64; the "
                          "chunked kernels split chunks into 16-token sub-blocks)")
    if m.mla_use_rope and m.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim={m.qk_rope_head_dim}: must be even when mla_use_rope=true")
    sv = cfg.serve
    for name in ("serve_max_batch", "serve_prefill_chunk"):
        if getattr(sv, name) <= 0:
            raise ConfigError(f"{name}={getattr(sv, name)}: must be positive")
    if sv.serve_max_queue < 0:
        raise ConfigError(f"serve_max_queue={sv.serve_max_queue}: must be >= 0")
    if not 0 <= sv.serve_port <= 65535:
        raise ConfigError(f"serve_port={sv.serve_port}: must be a TCP port (0..65535; 0 = any free port)")
    _validate_decode(cfg.decode)
    if not set(t.freeze) <= FREEZABLE:
        raise ConfigError(f"freeze={t.freeze}: unknown {sorted(set(t.freeze) - FREEZABLE)}; choose from {sorted(FREEZABLE)}")
    _validate_eval_and_sft(cfg)
    _validate_data(cfg.data)
    _mesh_divisibility(cfg, *_axis_sizes(cfg))   # what the axis sizes alone decide, devices or not
    _validate_processes(cfg)
    _validate_path_schemes(cfg)
    if num_devices is not None:
        mesh_shape(cfg, num_devices)
    if platform is not None and k.kda_impl == "pallas_tpu" and platform != "tpu" and not k.pallas_interpret:
        raise ConfigError(f"kda_impl=pallas_tpu compiles TPU kernels but the devices here are {platform}; "
                          f"use kda_impl=chunked (or pallas_interpret=true to run the kernel in the interpreter)")


def _validate_decode(d) -> None:
    if not 0 < d.top_p <= 1:
        raise ConfigError(f"top_p={d.top_p}: must be in (0, 1] (the nucleus probability mass; 1 = off)")
    if d.temperature < 0:
        raise ConfigError(f"temperature={d.temperature}: must be >= 0 (0 = greedy)")
    if d.top_k < 0:
        raise ConfigError(f"top_k={d.top_k}: must be >= 0 (0 = off)")
    if d.max_new_tokens <= 0:
        raise ConfigError(f"max_new_tokens={d.max_new_tokens}: must be positive")
    if d.max_prefill_length < 0:
        raise ConfigError(f"max_prefill_length={d.max_prefill_length}: must be >= 0 (0 = max_target_length)")


def _validate_data(d) -> None:
    if d.dataset_type != "synthetic" and not d.dataset_path:
        raise ConfigError(f"dataset_type={d.dataset_type} needs dataset_path (a glob of data files), "
                          f"or set dataset_type=synthetic")
    if not d.text_key:
        raise ConfigError("text_key is empty; name the JSON field or Parquet column holding the text")
    if d.bad_data_check_records < 0:
        raise ConfigError(f"bad_data_check_records={d.bad_data_check_records}: must be >= 0 (0 = no early check)")
    if not 0 <= d.bad_data_max_fraction <= 1:
        raise ConfigError(f"bad_data_max_fraction={d.bad_data_max_fraction}: must be within 0..1")


# Keys holding a path or a glob: local, or gs:// (k3jax.paths); any other scheme is an error.
PATH_KEYS = ("dataset_path", "tokenizer_path", "eval_dataset_path", "base_output_directory", "load_parameters_path",
             "golden", "jax_cache_dir")
SUPPORTED_SCHEMES = ("gs", "file")


def check_path_scheme(value, key: str) -> None:
    """ConfigError when ``value`` is a URL whose scheme k3jax cannot read or write (s3://, hdfs://)."""
    head, sep, _ = str(value).partition("://")
    if sep and head and "/" not in head and head.lower() not in SUPPORTED_SCHEMES:
        raise ConfigError(f"{key}={value}: the {head}:// scheme is not supported; use a local path or "
                          f"gs://bucket/...")


def _validate_path_schemes(cfg: Config) -> None:
    flat = cfg.flat()
    for key in PATH_KEYS:
        for part in str(flat[key] or "").split(","):
            check_path_scheme(part.strip(), key)


def _validate_processes(cfg: Config) -> None:
    m = cfg.mesh
    if m.num_processes is not None and m.num_processes < 1:
        raise ConfigError(f"num_processes={m.num_processes}: must be >= 1")
    if m.process_id is not None and not 0 <= m.process_id < (m.num_processes or m.process_id + 1):
        raise ConfigError(f"process_id={m.process_id}: must be in 0..num_processes-1={(m.num_processes or 1) - 1}")
    if m.jax_distributed_initialization_timeout <= 0:
        raise ConfigError(f"jax_distributed_initialization_timeout={m.jax_distributed_initialization_timeout}: "
                          f"must be a positive number of seconds")
    given = [k for k in ("coordinator_address", "num_processes", "process_id") if getattr(m, k) is not None]
    for key, v, lo in (("compile_topology_num_slices", cfg.compile.compile_topology_num_slices, 1),
                       ("profiler_steps", cfg.train.profiler_steps, 1),
                       ("skip_first_n_steps_for_profiler", cfg.train.skip_first_n_steps_for_profiler, 0)):
        if v < lo:
            raise ConfigError(f"{key}={v}: must be >= {lo}")
    if given and not m.enable_distributed:
        raise ConfigError(f"{', '.join(given)} set but enable_distributed=false; set enable_distributed=true "
                          f"to join a multi-process job")


def _validate_eval_and_sft(cfg: Config) -> None:
    e, d = cfg.eval, cfg.data
    if e.eval_interval <= 0:
        raise ConfigError(f"eval_interval={e.eval_interval}: must be positive (steps between evaluations)")
    if e.eval_steps == 0 or e.eval_steps < -1:
        raise ConfigError(f"eval_steps={e.eval_steps}: must be a positive number of batches, or -1 for one pass")
    if e.eval_per_device_batch_size < 0:
        raise ConfigError(f"eval_per_device_batch_size={e.eval_per_device_batch_size}: must be >= 0 "
                          f"(0 = per_device_batch_size)")
    if e.eval_dataset_path and d.dataset_type == "synthetic":
        raise ConfigError("eval_dataset_path is set but dataset_type=synthetic reads no files; set dataset_type to "
                          "the evaluation files' type (jsonl, parquet, arrayrecord or sft)")
    if d.num_epoch < 0:
        raise ConfigError(f"num_epoch={d.num_epoch}: must be >= 0 (0 = repeat the data until steps)")


def _axis_sizes(cfg: Config) -> tuple[dict, dict]:
    """The configured (ici, dcn) axis sizes, checked (-1 = fill, on one ici axis at most)."""
    m = cfg.mesh
    ici = {a: getattr(m, f"ici_{a}_parallelism") for a in MESH_AXES}
    dcn = {a: getattr(m, f"dcn_{a}_parallelism") for a in MESH_AXES}
    for where, sizes in (("ici", ici), ("dcn", dcn)):
        for a, s in sizes.items():
            if s == 0 or s < -1 or (where == "dcn" and s < 1):
                raise ConfigError(f"{where}_{a}_parallelism={s}: must be a positive size" +
                                  (" or -1 (fill)" if where == "ici" else ""))
    fills = [a for a, s in ici.items() if s == -1]
    if len(fills) > 1:
        raise ConfigError(f"only one ici_*_parallelism may be -1, got {', '.join(fills)}")
    return ici, dcn


def _mesh_divisibility(cfg: Config, ici: dict, dcn: dict) -> None:
    """Experts and heads must split evenly over the expert and tensor axes, the sequence into equal
    context slices; an axis still at -1 (filled from the devices) is checked once the devices are
    known."""
    mc = cfg.model
    if ici["expert"] != -1:
        ep = ici["expert"] * dcn["expert"]
        if mc.first_k_dense < mc.num_layers and mc.num_experts % ep:
            raise ConfigError(f"num_experts={mc.num_experts} is not divisible by expert parallelism {ep} "
                              f"(ici_expert_parallelism={ici['expert']} x dcn_expert_parallelism={dcn['expert']})")
    if ici["tensor"] != -1:
        tp = ici["tensor"] * dcn["tensor"]
        for name, heads in (("kda_num_heads", mc.kda_num_heads), ("num_attention_heads", mc.num_attention_heads)):
            if heads % tp:
                raise ConfigError(f"{name}={heads} is not divisible by tensor parallelism {tp} "
                                  f"(ici_tensor_parallelism={ici['tensor']} x dcn_tensor_parallelism={dcn['tensor']})")
    if ici["context"] != -1:
        cp = ici["context"] * dcn["context"]
        per_shard, rem = divmod(cfg.train.max_target_length, cp)
        if rem or (cp > 1 and per_shard < mc.kda_conv_size - 1):
            raise ConfigError(f"max_target_length={cfg.train.max_target_length} must split into {cp} context slices "
                              f"of equal length >= {mc.kda_conv_size - 1} (kda_conv_size - 1); change it or "
                              f"ici_/dcn_context_parallelism")


def mesh_shape(cfg: Config, num_devices: int, num_slices: int = 1) -> tuple[dict, dict]:
    """Resolve (ici, dcn) axis sizes for ``num_devices``; ``-1`` on one ICI axis fills the rest."""
    ici, dcn = _axis_sizes(cfg)
    dcn_prod = math.prod(dcn.values())
    if dcn_prod != num_slices:
        raise ConfigError(f"dcn parallelism product {dcn_prod} != number of slices {num_slices}")
    per_slice, rem = divmod(num_devices, num_slices)
    if rem:
        raise ConfigError(f"{num_devices} devices do not split into {num_slices} equal slices")
    fills = [a for a, s in ici.items() if s == -1]
    known = math.prod(s for s in ici.values() if s != -1)
    if fills:
        if per_slice % known:
            raise ConfigError(f"ici parallelism {known} (without the -1 axis) does not divide the "
                              f"{per_slice} devices per slice")
        ici[fills[0]] = per_slice // known
    if math.prod(ici.values()) != per_slice:
        desc = " x ".join(f"{a}={s}" for a, s in ici.items())
        raise ConfigError(f"mesh {desc} = {math.prod(ici.values())} devices, but {per_slice} are "
                          f"available per slice; set one ici_*_parallelism=-1 or fix the sizes")
    _mesh_divisibility(cfg, ici, dcn)
    return ici, dcn


FREEZABLE = frozenset({"embed", "attention", "kda", "mla", "moe", "experts", "router", "norms", "lm_head", "attn_res"})


def describe(cfg: Config) -> str:
    """Human-readable resolved config with the derived quantities."""
    from k3jax import counts
    lines = [f"# resolved config: model_name={cfg.model_name}"]
    for sec in SECTIONS:
        lines.append(f"## {sec}")
        for key, val in dataclasses.asdict(getattr(cfg, sec)).items():
            lines.append(f"{key}: {val!r}")
    m = cfg.model
    sched = cfg.model.schedule
    n_mla = sum(1 for mx, _ in sched if mx == "mla")
    total, active = counts.param_counts(m)
    lines += ["## derived",
              f"layers: {m.num_layers} = {m.num_layers - n_mla} KDA + {n_mla} MLA; "
              f"dense FFN layers: {m.first_k_dense}; MoE layers: {m.num_layers - m.first_k_dense}",
              f"MLA layers (0-based): {sorted(m.mla_layer_set)}",
              f"AttnRes block starts: {m.attn_res_block_starts or 'off'}",
              f"parameters: total {counts.human(total)} ({total:,}), active per token {counts.human(active)} ({active:,})",
              f"training FLOPs per token at T={cfg.train.max_target_length}: "
              f"{counts.human(counts.train_flops_per_token(m, cfg.train.max_target_length, cfg.kernel.kda_chunk_size))}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m k3jax.config configs/base.yml key=value ...``: print the resolved config."""
    import sys
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(usage("config", main.__doc__))
        return 0
    return guard(lambda: print(describe(load_from_argv(argv))))


def load_from_argv(argv: list[str]) -> Config:
    """``configs/base.yml key=value ...`` (the base path may be omitted)."""
    if argv and "=" not in argv[0]:
        return load(argv[0], argv[1:])
    return load(REPO_CONFIGS / "base.yml", argv)


if __name__ == "__main__":
    raise SystemExit(main())
