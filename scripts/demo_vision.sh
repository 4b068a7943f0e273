#!/usr/bin/env bash
# K3 sees, on a laptop CPU: make a synthetic image-caption set (coloured shapes on plain
# backgrounds, scripts/make_shapes_data.py), fine-tune a tiny K3 with the tiny vision tower on it
# through dataset_type=mm_sft (LLaVA / MindSpeed-MM layout, docs/data.md section 9), then caption
# held-out images it never saw with greedy decoding and print how many name the right colour and
# shape; the same model shown the held-out backgrounds without their shape is the control (chance
# is 1 in 12). tests/test_vision_learns.py runs a shorter version of this in CI.
#
# Knobs (environment): STEPS (300), TRAIN (960 images), OUT (runs) and RUN (demo_vision) for the
# run directory OUT/RUN, PY (the interpreter; default .venv's), EXTRA (further key=value overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
PY=${PY:-.venv/bin/python}
RUN=${RUN:-demo_vision}
OUT=${OUT:-runs}
STEPS=${STEPS:-300}
TRAIN=${TRAIN:-960}
read -r -a EXTRA <<< "${EXTRA:-}"
start=$(date +%s)
rm -rf "${OUT:?}/$RUN"
$PY scripts/make_shapes_data.py "$OUT/$RUN/data" --train "$TRAIN" --test 48 --size 28
# Two text layers (KDA with a dense FFN, then MLA with the MoE), the default tiny tower (2 blocks,
# width 32); each row (one conversation, one 28x28 image of 4 patches) fits the 4-patch bucket, and
# the captioning's batches of 16 images packed into one sequence the 64-patch one.
$PY -m k3jax.train configs/base.yml model_name=tiny vocab_size=1024 tokenizer_path=data/demo/tokenizer \
    num_layers=2 "mla_extra_layers=[1]" first_k_dense=1 attn_res=false \
    vision_enabled=true "vision_patch_buckets=[4,64]" vision_attention_block=64 \
    dataset_type=mm_sft dataset_path="$OUT/$RUN/data/train.json" sft_default_system_prompt=false \
    eval_dataset_path="$OUT/$RUN/data/test.json" eval_interval=100 eval_steps=-1 \
    max_target_length=48 per_device_batch_size=16 steps="$STEPS" learning_rate=0.01 \
    base_output_directory="$OUT" run_name="$RUN" checkpoint_period="$STEPS" log_period=25 "${EXTRA[@]}"
$PY scripts/make_shapes_data.py --score "$OUT/$RUN" "$OUT/$RUN/data"
echo "demo_vision: $(( $(date +%s) - start )) s"
