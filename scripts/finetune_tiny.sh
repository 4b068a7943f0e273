#!/usr/bin/env bash
# docs/fine-tuning.md end to end, on the tiny golden Kimi Linear model instead of the 48B one:
# the transformers checkpoint tests/assets/kimi_linear_tiny (plus a tiny Kimi tokenizer and a
# generation_config.json, as a released directory has them) is converted, fine-tuned for 10 SFT
# steps on tests/assets/chat_tiny with evaluation, exported back to Hugging Face format; then
# transformers (torch) loads the export with AutoModelForCausalLM, renders a chat with the export's
# own chat template, and its logits are compared with the k3jax checkpoint's by k3jax.logit_check.
#
# Needs the torch venv of scripts/make_goldens.py for step 4 (GOLDEN_PY, default
# .venv-golden/bin/python), with tiktoken installed in it (transformers reads tiktoken.model with
# it). W is the working directory (default runs/finetune-tiny).
set -euo pipefail
cd "$(dirname "$0")/.."
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
PY=${PY:-.venv/bin/python}
GOLDEN_PY=${GOLDEN_PY:-.venv-golden/bin/python}
W=${W:-runs/finetune-tiny}
HF=$W/Kimi-Linear-tiny
rm -rf "$W"
mkdir -p "$HF"
cp tests/assets/kimi_linear_tiny/config.json tests/assets/kimi_linear_tiny/model.safetensors "$HF/"
$PY -m k3jax.data.tiny_tokenizer "$HF" 512 26 >/dev/null
$PY - "$HF" <<'PY'
import json, sys
from k3jax.data.tokenizer import KimiTokenizer
t = KimiTokenizer.from_dir(sys.argv[1])
json.dump({"bos_token_id": t.bos_id, "eos_token_id": [t.eos_id, t.im_end_id], "do_sample": False},
          open(f"{sys.argv[1]}/generation_config.json", "w"))
PY

echo "== 1. convert"
$PY -m conversion.hf_to_k3jax --hf_dir "$HF" --out "$W/converted" --dtype float32 --quiet
echo "== 2. SFT with evaluation"
$PY -m k3jax.train configs/base.yml model_name="$W/converted/model.yml" load_parameters_path="$W/converted" \
    tokenizer_path="$W/converted" dataset_type=sft dataset_path=tests/assets/chat_tiny/train.jsonl \
    eval_dataset_path=tests/assets/chat_tiny/eval.jsonl eval_interval=5 eval_steps=2 steps=10 \
    max_target_length=128 per_device_batch_size=8 weight_dtype=float32 opt_type=adamw learning_rate=3e-3 \
    lr_schedule=constant warmup_steps_fraction=0 freeze=[embed] router_bias_update_rate=0 \
    checkpoint_period=5 log_period=1 base_output_directory="$W" run_name=sft
echo "== 3. export"
$PY -m conversion.k3jax_to_hf --ckpt "$W/sft/checkpoints/10" --out "$W/exported" --dtype float32 --quiet
echo "== 4. transformers loads the export"
$GOLDEN_PY scripts/hf_chat_logits.py "$W/exported" --out "$W/exported_logits.npz"
echo "== 5. k3jax checkpoint vs the export in transformers"
$PY -m k3jax.logit_check configs/base.yml model_name="$W/converted/model.yml" \
    load_parameters_path="$W/sft/checkpoints/10" golden="$W/exported_logits.npz" atol=1e-4 max_kl=1e-6
