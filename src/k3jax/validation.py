"""Config validation: every consistency check a config gets, apart from the type checks of
``k3jax.config.coerce``.

``validate(cfg)`` runs the checks that need no devices (``config.load`` and ``config.override`` call
it); ``num_devices`` adds the mesh checks and ``platform`` the kernel-placement ones (the CLI tools
call it again once the devices are known). ``mesh_shape`` resolves the ici/dcn axis sizes for a
device count. Every failure is a ``ConfigError`` with a one-line message a user can act on.
Imports only the schema, so any module may import this one.
"""
from __future__ import annotations

import math

from k3jax.layout import layout
from k3jax.remat import check as check_remat
from k3jax.schema import MESH_AXES, Config, ConfigError


def validate(cfg: Config, num_devices: int | None = None, platform: str | None = None) -> None:
    """Consistency checks that need no devices; ``num_devices`` adds the mesh checks and
    ``platform`` (the devices' platform, e.g. "cpu") the kernel-placement ones."""
    m, t, k = cfg.model, cfg.train, cfg.kernel
    positive = {"vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_layers": m.num_layers,
                "kda_num_heads": m.kda_num_heads, "kda_head_dim": m.kda_head_dim, "num_attention_heads":
                m.num_attention_heads, "num_experts_per_token": m.num_experts_per_token, "steps": t.steps,
                "max_target_length": t.max_target_length,
                "kda_chunk_size": k.kda_chunk_size, "attn_res_block_size": m.attn_res_block_size,
                "loss_chunk_size": k.loss_chunk_size,
                "gradient_accumulation_steps": t.gradient_accumulation_steps}
    for name, v in positive.items():
        if v <= 0:
            raise ConfigError(f"{name}={v}: must be positive")
    if m.mla_every < 0:
        raise ConfigError(f"mla_every={m.mla_every}: must be >= 0")
    if m.kda_gate == "bounded" and not -math.inf < m.kda_gate_lower_bound < 0:
        raise ConfigError(f"kda_gate_lower_bound={m.kda_gate_lower_bound}: the bounded gate lb*sigmoid(...) is a "
                          "log-decay, so lb must be a finite negative number (K3: -5.0)")
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
    if m.experts_qat == "mxfp4" and m.experts_format != "dense":
        raise ConfigError(f"experts_qat=mxfp4 trains dense master weights and rounds them in the forward, but "
                          f"experts_format={m.experts_format} keeps the experts packed; load the checkpoint with "
                          f"experts_format=dense (a packed conversion: convert it with --experts_format dense)")
    mx = "experts_format" if m.experts_format == "mxfp4" else "experts_qat" if m.experts_qat == "mxfp4" else None
    if mx and m.first_k_dense < m.num_layers:
        odd = {k: v for k, v in (("moe_intermediate_size", m.moe_intermediate_size),
                                 ("moe_latent_size" if m.moe_latent_size else "hidden_size", m.routed_width)) if v % 32}
        if odd:
            raise ConfigError(f"{mx}=mxfp4 needs the routed experts' input widths to be multiples of 32 "
                              f"(one E8M0 scale per 32 inputs); got {odd}")
    if m.experts_format == "mxfp4" and k.moe_impl == "tokamax_ragged_dot" and m.first_k_dense < m.num_layers:
        raise ConfigError("experts_format=mxfp4 with moe_impl=tokamax_ragged_dot: tokamax takes quantized experts as "
                          "qwix QArrays and our packed MXFP4 is not one; use moe_impl=megablox (TPU kernel on the "
                          "packed weights) or moe_impl=ragged_dot (dequantizes first)")
    if m.attn_res and m.attn_res_block_size > m.num_layers:
        raise ConfigError(f"attn_res_block_size={m.attn_res_block_size} exceeds num_layers={m.num_layers}")
    if k.moe_gather_max_tokens < 0:
        raise ConfigError(f"moe_gather_max_tokens={k.moe_gather_max_tokens}: must be >= 0 (0 turns the few-token "
                          "MoE dispatch off)")
    if k.kda_chunk_size < 16 or k.kda_chunk_size & (k.kda_chunk_size - 1):
        raise ConfigError(f"kda_chunk_size={k.kda_chunk_size}: must be a power of two >= 16 (e.g. 64; the "
                          "chunked kernels split chunks into 16-token sub-blocks)")
    _validate_tokamax_kda(cfg)
    if k.loss_impl == "tokamax" and t.z_loss_weight:
        raise ConfigError(f"loss_impl=tokamax has no z-loss (tokamax's fused CE returns no log-partition), but "
                          f"z_loss_weight={t.z_loss_weight}; set z_loss_weight=0 or loss_impl=chunked")
    if m.mla_use_rope and m.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim={m.qk_rope_head_dim}: must be even when mla_use_rope=true")
    sv = cfg.serve
    for name in ("serve_max_batch", "serve_prefill_chunk", "serve_prefill_batch", "serve_decode_steps"):
        if getattr(sv, name) <= 0:
            raise ConfigError(f"{name}={getattr(sv, name)}: must be positive")
    if sv.serve_max_queue < 0:
        raise ConfigError(f"serve_max_queue={sv.serve_max_queue}: must be >= 0")
    if sv.serve_max_decode_wait < 0:
        raise ConfigError(f"serve_max_decode_wait={sv.serve_max_decode_wait}: must be >= 0 (0 = decode after every "
                          f"prefill step)")
    if not 0 <= sv.serve_port <= 65535:
        raise ConfigError(f"serve_port={sv.serve_port}: must be a TCP port (0..65535; 0 = any free port)")
    _validate_serve_cache(sv)
    _validate_decode(cfg.decode)
    _validate_images(cfg)
    if not set(t.freeze) <= FREEZABLE:
        raise ConfigError(f"freeze={t.freeze}: unknown {sorted(set(t.freeze) - FREEZABLE)}; choose from {sorted(FREEZABLE)}")
    if VISION_GROUPS & set(t.freeze) and not cfg.vision.vision_enabled:
        raise ConfigError(f"freeze={t.freeze}: {sorted(VISION_GROUPS & set(t.freeze))} freeze the vision side but "
                          f"vision_enabled=false; drop them or use a vision model (e.g. model_name=kimi-k3-vl)")
    if cfg.compile.compile_images_per_sequence and not cfg.vision.vision_enabled:
        raise ConfigError(f"compile_images_per_sequence={cfg.compile.compile_images_per_sequence} needs a vision model "
                          f"but vision_enabled=false; use model_name=kimi-k3-vl or set it to 0")
    if cfg.compile.compile_images_per_sequence < 0 or cfg.compile.compile_image_size < 1:
        raise ConfigError("compile_images_per_sequence must be >= 0 and compile_image_size >= 1 (pixels)")
    _validate_eval_and_sft(cfg)
    _validate_data(cfg.data)
    _validate_rl(cfg)
    _validate_vision(cfg, platform)
    check_remat(cfg, platform)     # names the model tags; an offload on a platform without host memory
    _mesh_divisibility(cfg, *_axis_sizes(cfg))   # what the axis sizes alone decide, devices or not
    _validate_pipeline(cfg, num_devices)
    _validate_processes(cfg)
    _validate_path_schemes(cfg)
    if num_devices is not None:
        _validate_vocab_parallel(cfg, *mesh_shape(cfg, num_devices))
    if platform not in (None, "tpu") and k.loss_impl == "tokamax" and m.vocab_size % 2048:
        raise ConfigError(f"loss_impl=tokamax runs tokamax's chunked XLA loss on {platform}, which is wrong unless "
                          f"vocab_size is a multiple of 2048 (it lets padded logits into the softmax); vocab_size="
                          f"{m.vocab_size}: use loss_impl=chunked or a vocab_size multiple of 2048")
    if platform is not None and k.kda_impl == "pallas_tpu" and platform != "tpu" and not k.pallas_interpret:
        raise ConfigError(f"kda_impl=pallas_tpu compiles TPU kernels but the devices here are {platform}; "
                          f"use kda_impl=chunked (or pallas_interpret=true to run the kernel in the interpreter)")
    if platform is not None:
        _validate_platform_kernels(cfg, platform, None if num_devices is None else mesh_shape(cfg, num_devices))


def _validate_platform_kernels(cfg: Config, platform: str, mesh: tuple[dict, dict] | None) -> None:
    """Explicit kernel choices the devices' platform cannot run (``auto`` always resolves to one it
    can: k3jax.kernels.platform.AUTO)."""
    k, m = cfg.kernel, cfg.model
    gpu = platform in ("gpu", "cuda", "rocm")
    if k.attention_impl == "cudnn" and not gpu:
        raise ConfigError(f"attention_impl=cudnn runs cuDNN's GPU kernel but the devices here are {platform}; "
                          f"use attention_impl=auto (or jnp / blocked)")
    if k.attention_impl == "cudnn" and cfg.train.dtype not in ("bfloat16", "float16"):
        raise ConfigError(f"attention_impl=cudnn takes bfloat16 or float16 activations, but dtype={cfg.train.dtype}; "
                          f"set dtype=bfloat16 or attention_impl=auto")
    if mesh is not None and platform == "cpu" and k.moe_ep_transport == "ragged" and m.first_k_dense < m.num_layers:
        ici, dcn = mesh
        if ici["expert"] * dcn["expert"] > 1:
            raise ConfigError("moe_ep_transport=ragged needs ragged_all_to_all, which XLA:CPU does not implement; "
                              "use moe_ep_transport=auto (padded on CPU) or padded")


# Mesh axes loss_impl=vocab_parallel may split the lm head's vocabulary over: the head's own
# vocabulary axis and the parameter-sharding axes (k3jax.sharding checks it against its rules at
# import; k3jax.loss.choose_vocab_axes picks the group). Here, not there: sharding imports config.
VOCAB_PARALLEL_AXES = ("tensor", "fsdp", "expert", "context")


def _validate_vocab_parallel(cfg: Config, ici: dict, dcn: dict) -> None:
    """loss_impl=vocab_parallel on more than one device needs a vocabulary axis to split: one of
    the axes it may use (VOCAB_PARALLEL_AXES) whose size divides vocab_size. Without one
    every device would hold the whole lm head, which is what this loss is chosen to avoid."""
    if cfg.kernel.loss_impl != "vocab_parallel" or math.prod(ici.values()) * math.prod(dcn.values()) == 1:
        return
    v = cfg.model.vocab_size
    sizes = {a: ici[a] * dcn[a] for a in VOCAB_PARALLEL_AXES}
    if not any(s > 1 and v % s == 0 for s in sizes.values()):
        raise ConfigError(f"loss_impl=vocab_parallel splits the vocabulary over one of the mesh axes {sizes}, but none "
                          f"of them (size > 1) divides vocab_size={v}; use loss_impl=chunked or a mesh/vocabulary "
                          "that divides")


def _validate_tokamax_kda(cfg: Config) -> None:
    """kda_impl=tokamax: tokamax fuses only the bounded (K3) gate and runs only 64-token chunks."""
    k, m = cfg.kernel, cfg.model
    if k.kda_impl != "tokamax":
        return
    if m.kda_gate != "bounded" or not -5.0 <= m.kda_gate_lower_bound < 0.0:
        raise ConfigError(f"kda_impl=tokamax needs kda_gate=bounded with kda_gate_lower_bound in [-5, 0) (got "
                          f"{m.kda_gate}, {m.kda_gate_lower_bound}); use kda_impl=chunked for this model")
    if k.kda_chunk_size != 64:
        raise ConfigError(f"kda_impl=tokamax runs 64-token chunks only; set kda_chunk_size=64 (got {k.kda_chunk_size})")
    if k.kda_tokamax_max_segments < 1:
        raise ConfigError(f"kda_tokamax_max_segments={k.kda_tokamax_max_segments}: must be >= 1")
    ici, dcn = _axis_sizes(cfg)
    if ici["context"] != 1 or dcn["context"] != 1:
        raise ConfigError("kda_impl=tokamax does not run under context parallelism here; use kda_impl=chunked or "
                          "pallas_tpu, or ici_/dcn_context_parallelism=1")


def _validate_vision(cfg: Config, platform: str | None) -> None:
    """The vision tower's shapes (docs/vision.md), checked only with vision_enabled=true."""
    v = cfg.vision
    if not v.vision_enabled:
        return
    for name in ("vision_patch_size", "vision_merge_kernel_size", "vision_hidden_size", "vision_num_layers",
                 "vision_num_heads", "vision_head_dim", "vision_mlp_dim", "vision_pos_emb_height",
                 "vision_pos_emb_width", "vision_pos_emb_time", "vision_attention_block"):
        if getattr(v, name) <= 0:
            raise ConfigError(f"{name}={getattr(v, name)}: must be positive")
    if v.vision_projector_hidden_size is not None and v.vision_projector_hidden_size <= 0:
        raise ConfigError(f"vision_projector_hidden_size={v.vision_projector_hidden_size}: must be positive (or null)")
    if v.vision_head_dim % 4:
        raise ConfigError(f"vision_head_dim={v.vision_head_dim}: must be a multiple of 4 (the 2-D RoPE rotates "
                          "Dh/2 pairs, alternately by column and row)")
    if v.vision_pos_emb_time > 1 and v.vision_hidden_size % 2:
        raise ConfigError(f"vision_hidden_size={v.vision_hidden_size}: must be even when vision_pos_emb_time > 1 "
                          "(the temporal term is a sin half and a cos half)")
    for name in ("vision_norm_eps", "vision_projector_eps"):
        if not getattr(v, name) > 0:
            raise ConfigError(f"{name}={getattr(v, name)}: must be positive")
    if platform not in (None, "tpu") and v.vision_attention_impl == "splash" and not cfg.kernel.pallas_interpret:
        raise ConfigError(f"vision_attention_impl=splash compiles TPU kernels but the devices here are {platform}; "
                          "use vision_attention_impl=blocked (or pallas_interpret=true)")


def _validate_serve_cache(sv) -> None:
    """Decode buckets and the prefix cache (k3jax.inference.programs / prefix_cache)."""
    b = sv.serve_decode_buckets
    if b and (not all(isinstance(x, int) and 1 <= x <= sv.serve_max_batch for x in b) or b != sorted(set(b))
              or b[-1] != sv.serve_max_batch):
        raise ConfigError(f"serve_decode_buckets={b}: must be increasing distinct batch sizes in 1..serve_max_batch "
                          f"ending with serve_max_batch={sv.serve_max_batch} (e.g. [1, 4, {sv.serve_max_batch}]), "
                          f"or [] for the powers of two")
    if sv.serve_prefix_block < 0 or sv.serve_prefix_block % sv.serve_prefill_chunk:
        raise ConfigError(f"serve_prefix_block={sv.serve_prefix_block}: must be a multiple of serve_prefill_chunk="
                          f"{sv.serve_prefill_chunk} (or 0 = serve_prefill_chunk)")
    if sv.serve_prefix_cache_bytes < 0:
        raise ConfigError(f"serve_prefix_cache_bytes={sv.serve_prefix_cache_bytes}: must be >= 0 (0 = no prefix cache)")
    d = sv.serve_image_url_domains
    if not all(isinstance(x, str) and x.strip(".") and "/" not in x and ":" not in x for x in d):
        raise ConfigError(f"serve_image_url_domains={d}: must be host names (e.g. [images.example.com] or "
                          f"[.example.com] for its subdomains), without scheme, port or path")
    if sv.serve_image_max_bytes < 1:
        raise ConfigError(f"serve_image_max_bytes={sv.serve_image_max_bytes}: must be >= 1 (bytes one image may carry)")
    if not sv.serve_image_fetch_timeout_s > 0:
        raise ConfigError(f"serve_image_fetch_timeout_s={sv.serve_image_fetch_timeout_s}: must be > 0 (seconds)")


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


def rl_reward_specs(entries: list) -> list[tuple[str, float]]:
    """rl_rewards entries -> [(NAME or module:function, weight)]; ``SPEC=WEIGHT`` sets the weight (default 1).
    ConfigError for an entry that is not such a string (k3jax.rl.rewards resolves the specs)."""
    out = []
    for e in entries:
        spec, sep, weight = str(e).rpartition("=") if isinstance(e, str) and "=" in e else (e, "", "1")
        if not isinstance(spec, str) or not spec.strip() or spec != spec.strip() or " " in spec:
            raise ConfigError(f"rl_rewards entry {e!r}: must be NAME or module:function, optionally =WEIGHT "
                              "(e.g. exact_match, format=0.1, my_pkg.rewards:score=0.5)")
        try:
            w = float(weight)
        except ValueError:
            raise ConfigError(f"rl_rewards entry {e!r}: the weight {weight!r} after '=' is not a number") from None
        if not math.isfinite(w):
            raise ConfigError(f"rl_rewards entry {e!r}: the weight must be finite")
        if spec.count(":") > 1 or spec.startswith(":") or spec.endswith(":"):
            raise ConfigError(f"rl_rewards entry {e!r}: a user reward is module:function (one ':')")
        out.append((spec, w))
    return out


def _validate_rl(cfg: Config) -> None:
    """The rl section (docs/rl.md): group size, clip ranges, reward list, sampling. Its values only; a prompt plus
    rl_max_new_tokens against max_target_length is checked per prompt (k3jax.rl.prompts), since every tool
    validates this section and a training config may have a shorter max_target_length."""
    r = cfg.rl
    if r.rl_num_generations < 2:
        raise ConfigError(f"rl_num_generations={r.rl_num_generations}: GRPO's advantages are relative to the group "
                          f"of completions of one prompt (r - group mean), so with fewer than 2 every advantage is "
                          f"0 and nothing is learned; use >= 2 (e.g. 8)")
    if r.rl_num_iterations < 1:
        raise ConfigError(f"rl_num_iterations={r.rl_num_iterations}: must be >= 1 (optimizer steps per rollout batch)")
    if r.rl_beta < 0:
        raise ConfigError(f"rl_beta={r.rl_beta}: must be >= 0 (0 = no KL term)")
    if not 0 < r.rl_epsilon < 1:
        raise ConfigError(f"rl_epsilon={r.rl_epsilon}: must be in (0, 1) (the ratio is clipped below at 1 - it)")
    if r.rl_epsilon_high <= 0:
        raise ConfigError(f"rl_epsilon_high={r.rl_epsilon_high}: must be > 0 (the ratio is clipped above at 1 + it)")
    if r.rl_tis_cap != 0 and r.rl_tis_cap < 1:
        raise ConfigError(f"rl_tis_cap={r.rl_tis_cap}: must be 0 (off) or >= 1 (a cap below 1 would shrink every "
                          "on-policy token's weight; Yao et al. use 2)")
    if not r.rl_rewards:
        raise ConfigError("rl_rewards=[]: give at least one reward (e.g. [exact_match])")
    rl_reward_specs(r.rl_rewards)
    if r.rl_max_turns < 1:
        raise ConfigError(f"rl_max_turns={r.rl_max_turns}: must be >= 1")
    for t in r.rl_tools:
        target = str(t).rpartition("=")[2]
        if ":" not in target or not all(target.partition(":")[::2]):
            raise ConfigError(f"rl_tools entry {t!r}: write it as name=module:function (or module:function)")
    if r.rl_tool_timeout_s <= 0:
        raise ConfigError(f"rl_tool_timeout_s={r.rl_tool_timeout_s}: must be > 0")
    if r.rl_max_new_tokens < 1:
        raise ConfigError(f"rl_max_new_tokens={r.rl_max_new_tokens}: must be positive")
    if r.rl_temperature <= 0:
        raise ConfigError(f"rl_temperature={r.rl_temperature}: must be > 0 (rollouts sample; the loss needs the "
                          "log-probs of the distribution sampled from)")
    if not 0 < r.rl_top_p <= 1:
        raise ConfigError(f"rl_top_p={r.rl_top_p}: must be in (0, 1] (1 = off)")


def _validate_images(cfg: Config) -> None:
    """decode's images=[...]: paths, a model with the tower, at most vision_max_images."""
    images, v = cfg.decode.images, cfg.vision
    if not images:
        return
    if not all(isinstance(x, str) and x for x in images):
        raise ConfigError(f"images={images}: must be a list of image paths (local or gs://)")
    if not v.vision_enabled:
        raise ConfigError(f"images={images} needs a model with the vision tower, but vision_enabled=false; "
                          f"use a vision model config (e.g. model_name=kimi-k3-vl) or drop images=")
    if v.vision_max_images and len(images) > v.vision_max_images:
        raise ConfigError(f"images= has {len(images)} images, over vision_max_images={v.vision_max_images}; "
                          f"raise vision_max_images or pass fewer images")
    for x in images:
        check_path_scheme(x, "images")


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
             "golden", "jax_cache_dir", "image_root")
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
    if d.dataset_type == "mm_sft":
        _validate_mm_sft(cfg)


def _validate_mm_sft(cfg: Config) -> None:
    """dataset_type=mm_sft (k3jax.data.mm_sft): image conversations need the tower."""
    if not cfg.vision.vision_enabled:
        raise ConfigError("dataset_type=mm_sft trains on images but vision_enabled=false; use a vision model config "
                          "(e.g. model_name=kimi-k3-vl) or set vision_enabled=true")


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


def stage_sizes(cfg: Config) -> tuple[int, int]:
    """(ici, dcn) sizes of the ``stage`` mesh axis (pipeline stages; k3jax.stages), checked. The axis
    is kept apart from MESH_AXES: meshes without a pipeline stay exactly as they were."""
    m = cfg.mesh
    sizes = (m.ici_stage_parallelism, m.dcn_stage_parallelism)
    for where, s in zip(("ici", "dcn"), sizes):
        if s < 1:
            raise ConfigError(f"{where}_stage_parallelism={s}: must be a positive size (-1 fill is not offered for stages)")
    return sizes


def num_stages(cfg: Config) -> int:
    ici, dcn = stage_sizes(cfg)
    return ici * dcn


def pipeline_microbatches(cfg: Config) -> int:
    """num_pipeline_microbatches with -1 resolved to the stage count."""
    m = cfg.train.num_pipeline_microbatches
    return num_stages(cfg) if m == -1 else m


def _validate_pipeline(cfg: Config, num_devices: int | None) -> None:
    """stage > 1 (k3jax.stages): what the pipeline runs today, each refusal with what to change."""
    s, m = num_stages(cfg), cfg.train.num_pipeline_microbatches
    if m == 0 or m < -1:
        raise ConfigError(f"num_pipeline_microbatches={m}: must be positive, or -1 (= the stage count)")
    if s == 1:
        return
    mc, t, mesh = cfg.model, cfg.train, cfg.mesh
    name = f"stage parallelism {s} (ici_stage_parallelism={mesh.ici_stage_parallelism} x dcn_stage_parallelism=" \
           f"{mesh.dcn_stage_parallelism})"
    periods = layout(mc, t.scan_layers).num_periods
    if not t.scan_layers:
        raise ConfigError(f"{name} pipelines the scanned layer periods, but scan_layers=false; set scan_layers=true")
    if periods % s:
        raise ConfigError(f"{name} does not divide the {periods} scanned layer periods of this model; use a stage "
                          f"count dividing {periods}")
    mb = pipeline_microbatches(cfg)
    if mb % s:
        raise ConfigError(f"num_pipeline_microbatches={mb} is not a multiple of the {s} pipeline stages; use "
                          f"{s}, {2 * s}, ...")
    if mesh.ici_tensor_parallelism * mesh.dcn_tensor_parallelism != 1:
        raise ConfigError(f"{name} with tensor parallelism is not supported yet (untested); set "
                          f"ici_/dcn_tensor_parallelism=1")
    if cfg.vision.vision_enabled:
        raise ConfigError(f"{name} with the vision tower (vision_enabled=true) is not supported yet (untested); "
                          f"train vision models without stages")
    if t.attn_res_segment_scan:
        raise ConfigError(f"{name} with attn_res_segment_scan=true: the pipeline runs the flat period scan; set "
                          f"attn_res_segment_scan=false")
    if num_devices is not None:
        rows = cfg.global_batch_size(num_devices) // t.gradient_accumulation_steps
        ici, dcn = mesh_shape(cfg, num_devices)
        shards = math.prod(ici[a] * dcn[a] for a in ("data", "fsdp", "expert"))
        if rows % mb or (rows // mb) % shards:
            raise ConfigError(f"num_pipeline_microbatches={mb}: a batch of {rows} rows does not split into {mb} "
                              f"microbatches of whole rows on each of the {shards} data x fsdp x expert shards of "
                              f"a stage; use fewer microbatches or a larger per_device_batch_size")


def mesh_shape(cfg: Config, num_devices: int, num_slices: int = 1) -> tuple[dict, dict]:
    """Resolve (ici, dcn) axis sizes for ``num_devices``; ``-1`` on one ICI axis fills the rest.
    The ``stage`` axis (``stage_sizes``) takes its share of the devices first and is not in the dicts."""
    ici, dcn = _axis_sizes(cfg)
    ici_stage, dcn_stage = stage_sizes(cfg)
    dcn_prod = math.prod(dcn.values()) * dcn_stage
    if dcn_prod != num_slices:
        raise ConfigError(f"dcn parallelism product {dcn_prod} != number of slices {num_slices}")
    per_slice, rem = divmod(num_devices, num_slices)
    if rem:
        raise ConfigError(f"{num_devices} devices do not split into {num_slices} equal slices")
    if per_slice % ici_stage:
        raise ConfigError(f"ici_stage_parallelism={ici_stage} does not divide the {per_slice} devices per slice")
    per_slice //= ici_stage
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


FREEZABLE = frozenset({"embed", "attention", "kda", "mla", "moe", "experts", "router", "norms", "lm_head", "attn_res",
                       "vision", "projector"})
VISION_GROUPS = frozenset({"vision", "projector"})   # params["vision"]: the tower, the projector
