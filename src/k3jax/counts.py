"""Parameter counts and analytic FLOPs per token, from the model config alone.

The counts follow the checkpoint shapes of k3-architecture.md §8 (and §9 for Kimi Linear), one term
per weight; `state.abstract_state()` must agree with them exactly (tested). FLOPs count a multiply-add as 2.

Letters: D hidden, V vocab, H heads, dk/dv head dims, P = H*dk, C KDA chunk, T sequence length,
E experts, k top-k, L routed width (latent), F expert width, S AttnRes sources.
"""
from __future__ import annotations


def kda_params(m) -> int:
    d, h, dk = m.hidden_size, m.kda_num_heads, m.kda_head_dim
    p = h * dk
    n = 3 * p * d + 3 * p * m.kda_conv_size               # q/k/v projections + depthwise convs
    n += m.kda_gate_rank * d + p * m.kda_gate_rank         # f_a, f_b
    n += h + p                                             # A_log (one per head), dt_bias
    n += h * d + dk                                        # b_proj, o_norm (shared by heads)
    if m.kda_output_gate == "full":
        n += p * d                                         # g_proj
    else:
        n += m.kda_output_gate_rank * d + p * m.kda_output_gate_rank   # g_a, g_b
    return n + d * p                                       # o_proj


def mla_params(m) -> int:
    d, h = m.hidden_size, m.num_attention_heads
    qk, dv, r = m.qk_head_dim, m.v_head_dim, m.kv_lora_rank
    if m.q_lora_rank:
        n = d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * h * qk
    else:
        n = d * h * qk
    n += d * (r + m.qk_rope_head_dim) + r                  # kv_a_proj_with_mqa, kv_a_layernorm
    n += r * h * (m.qk_nope_head_dim + dv)                 # kv_b_proj
    if m.mla_use_output_gate:
        n += d * h * dv                                    # g_proj
    return n + h * dv * d                                  # o_proj


def dense_ffn_params(m) -> int:
    return 3 * m.hidden_size * m.intermediate_size


def expert_params(m) -> int:
    """One routed expert (gate, up, down) at the routed width."""
    return 3 * m.routed_width * m.moe_intermediate_size


def moe_params(m, *, active: bool) -> int:
    d, e = m.hidden_size, m.num_experts
    n = e * d + e                                           # router + e_score_correction_bias
    if m.moe_latent_size:
        n += 2 * d * m.moe_latent_size + (m.moe_latent_size if m.moe_latent_norm else 0)
    n += (m.num_experts_per_token if active else e) * expert_params(m)
    return n + 3 * d * m.num_shared_experts * m.moe_intermediate_size


def layer_params(m, layer: int, *, active: bool = False) -> int:
    d = m.hidden_size
    n = 2 * d                                               # input / post-attention norms
    if m.attn_res:
        n += 4 * d                                          # two (res_proj, res_norm) pairs
    n += kda_params(m) if m.mixer(layer) == "kda" else mla_params(m)
    n += dense_ffn_params(m) if m.ffn(layer) == "dense" else moe_params(m, active=active)
    return n


def param_counts(m) -> tuple[int, int]:
    """(total, active per token). Active excludes the input embedding (a lookup, not compute) and
    counts k of E routed experts; K3: ~2.78T total, ~104.2B active (k3-architecture.md §1)."""
    d, v = m.hidden_size, m.vocab_size
    glob = d + (2 * d if m.attn_res else 0)                 # final norm (+ output AttnRes pair)
    head = 0 if m.tie_word_embeddings else v * d
    total = v * d + head + glob + sum(layer_params(m, l) for l in range(m.num_layers))
    active = v * d + glob + sum(layer_params(m, l, active=True) for l in range(m.num_layers))
    return total, active


def kda_chunked_flops_per_token(h: int, dk: int, dv: int, chunk: int) -> float:
    """Forward FLOPs per token of the chunked KDA core (all heads).

    Per head and token: intra-chunk scores A_kk and A_qk (2·C·dk each, full C x C blocks), the
    triangular solve (C² / 2 multiply-adds ~ C²), u = A v and w = A (k·γ) (2·C·dv + 2·C·dk),
    intra output (2·C·dv), and state work: w S, q S, kᵀ u updates (3 x 2·dk·dv) plus the decay (dk·dv).
    """
    c = chunk
    per_head = 2 * c * dk * 3 + c * c + 2 * c * dv * 2 + 7 * dk * dv
    return float(h * per_head)


def mla_attention_flops_per_token(m, seq_len: int) -> float:
    """Causal attention core, forward: scores (qk) and values (dv) against T/2 keys on average."""
    return 2.0 * m.num_attention_heads * (m.qk_head_dim + m.v_head_dim) * seq_len / 2


def attn_res_flops_per_token(m) -> float:
    """Each site: RMS of S sources (3·D each), S dots with γ·w (2·D), a weighted sum (2·D)."""
    if not m.attn_res:
        return 0.0
    total = 0.0
    for l in range(m.num_layers):
        sources = 1 + sum(1 for s in m.attn_res_block_starts if s <= l) + 1
        total += 2 * sources * 7 * m.hidden_size
    return total + (1 + len(m.attn_res_block_starts)) * 7 * m.hidden_size


def forward_flops_per_token(m, seq_len: int, kda_chunk: int = 64) -> float:
    _, active = param_counts(m)
    matmul = 2.0 * (active - m.hidden_size * (1 + (2 if m.attn_res else 0)))  # norms are not matmuls
    n_mla = len(m.mla_layer_set)
    n_kda = m.num_layers - n_mla
    core = n_mla * mla_attention_flops_per_token(m, seq_len)
    core += n_kda * kda_chunked_flops_per_token(m.kda_num_heads, m.kda_head_dim, m.kda_head_dim, kda_chunk)
    return matmul + core + attn_res_flops_per_token(m)


def train_flops_per_token(m, seq_len: int, kda_chunk: int = 64) -> float:
    """Forward + backward (= 3 x forward), without rematerialisation (model FLOPs, for MFU)."""
    return 3.0 * forward_flops_per_token(m, seq_len, kda_chunk)


def vision_params(v, text_hidden: int) -> tuple[int, int]:
    """(tower, projector) parameter counts of a ``vision`` config section (docs/vision.md §6):
    K3 401.2M / 46.1M, K2.5 416.9M / 54.3M (vision.md §0)."""
    d, p, q, f = v.vision_hidden_size, v.vision_patch_size, v.qkv_width, v.vision_mlp_dim
    norm = d * (2 if v.vision_norm == "layernorm" else 1)
    tower = 3 * p * p * d + (d if v.vision_patch_bias else 0) + v.vision_pos_emb_height * v.vision_pos_emb_width * d
    block = 2 * norm + 3 * q * d + q * d + 2 * d * f
    block += (3 * q + d) * v.vision_attn_bias + (f + d) * v.vision_mlp_bias
    tower += v.vision_num_layers * block + norm
    din, hid = v.merged_width, v.projector_hidden
    proj = din * hid + hid * text_hidden
    proj += 2 * d + hid + text_hidden if v.vision_projector == "patchmerger" else text_hidden
    return tower, proj


def vision_forward_flops(v, text_hidden: int, grids) -> tuple[float, float]:
    """Forward FLOPs (tower, projector) of encoding media of ``grids`` [(t, h, w), ...]: per patch
    the patch embedding (2·3p²·D) and per block qkv, wo, fc0, fc1 (2·(4·Q·D + 2·D·F), Q = H·Dh);
    per media item of n = t·h·w patches, bidirectional attention within the item (scores and values:
    2 x 2·n²·Q per block); per merged token ((h/k)(w/k) per item) the projector's two matmuls.
    Norms, the position-table gather and the merge's mean are left out (not matmuls)."""
    d, p, q, f, k = (v.vision_hidden_size, v.vision_patch_size, v.qkv_width, v.vision_mlp_dim,
                     v.vision_merge_kernel_size)
    per_patch = 2.0 * 3 * p * p * d + v.vision_num_layers * 2.0 * (4 * q * d + 2 * d * f)
    per_token = 2.0 * (v.merged_width * v.projector_hidden + v.projector_hidden * text_hidden)
    tower = proj = 0.0
    for t, h, w in grids:
        n = t * h * w
        tower += n * per_patch + v.vision_num_layers * 4.0 * n * n * q
        proj += (h // k) * (w // k) * per_token
    return tower, proj


def vision_train_flops(v, text_hidden: int, grids, freeze=()) -> float:
    """Model FLOPs of the vision side in one train step (for MFU): a trained part counts forward +
    backward (3 x forward), a frozen part its forward only, except a frozen projector behind a
    trained tower, whose backward still carries the tower's gradient (2 x forward: no weight
    gradients)."""
    tower, proj = vision_forward_flops(v, text_hidden, grids)
    t_frozen, p_frozen = "vision" in freeze, "projector" in freeze
    return tower * (1.0 if t_frozen else 3.0) + proj * ((1.0 if t_frozen else 2.0) if p_frozen else 3.0)


def decode_cache_bytes(m, length: int, *, context: int = 1, latent_bytes: int = 4, state_bytes: int = 4) -> dict:
    """Decode cache of one sequence of ``length`` tokens, per device of a ``context``-way split
    (the MLA latent's cache_seq axis maps to the context mesh axis; KDA's state is length-free and
    whole on every context shard). -> bytes per entry and "total".

    - mla_latent: T x (kv_lora_rank + qk_rope_head_dim) per MLA layer (the compressed latent and
      the shared rope key: all MLA caches), split over the context shards;
    - kda_state: the recurrent state H x dk x dv per KDA layer;
    - kda_conv: the last kda_conv_size - 1 inputs of the q, k and v convs, 3 x P x (W - 1).

    ``latent_bytes`` / ``state_bytes``: bytes per value (model.cache_spec keeps both in f32: 4;
    a bf16 cache halves the latent). Batch rows multiply everything; a tensor axis would further
    split the KDA heads (not counted here)."""
    n_mla = len(m.mla_layer_set)
    n_kda = m.num_layers - n_mla
    h, dk = m.kda_num_heads, m.kda_head_dim
    out = {"mla_latent": n_mla * -(-length // context) * (m.kv_lora_rank + m.qk_rope_head_dim) * latent_bytes,
           "kda_state": n_kda * h * dk * dk * state_bytes,
           "kda_conv": n_kda * 3 * h * dk * (m.kda_conv_size - 1) * state_bytes}
    out["total"] = sum(out.values())
    return out


def human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"
