#!/usr/bin/env bash
# The main job on CPU: train the tiny K3-shaped model (base.yml defaults, vocabulary 1024) on
# Alice's Adventures in Wonderland (data/demo/: the book as JSONL paragraphs and its byte-level BPE
# tokenizer in the Kimi tiktoken layout, read through tokenizer_path like a real Kimi tokenizer),
# checkpoint it, continue a prompt from the checkpoint, draw the loss curve and say how many of the
# generated words are words of the book.
#
# Knobs (environment): STEPS (400), PROMPT, RUN (demo) and OUT (runs) for the run directory
# OUT/RUN, PY (the interpreter; default .venv's), EXTRA (further key=value overrides of the model,
# given to train and decode; tests/test_demo.py runs a shorter, smaller variant this way).
set -euo pipefail
cd "$(dirname "$0")/.."
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
PY=${PY:-.venv/bin/python}
RUN=${RUN:-demo}
OUT=${OUT:-runs}
STEPS=${STEPS:-400}
PROMPT=${PROMPT:-Alice was}
read -r -a EXTRA <<< "${EXTRA:-}"
BOOK=(vocab_size=1024 base_output_directory="$OUT" "${EXTRA[@]}")
start=$(date +%s)
rm -rf "${OUT:?}/$RUN"
$PY -m k3jax.train configs/base.yml run_name="$RUN" steps="$STEPS" "${BOOK[@]}" tokenizer_path=data/demo/tokenizer \
    dataset_type=jsonl \
    dataset_path=data/demo/alice.jsonl per_device_batch_size=8 checkpoint_period=200 log_period=50
# Sampled (temperature 0.7 among the 20 likeliest tokens, fixed seed): greedy decoding of a model
# this small repeats one phrase. No tokenizer_path: decode reads the tokenizer the run recorded in
# OUT/RUN/tokenizer, as for any checkpoint.
$PY -m k3jax.decode configs/base.yml "${BOOK[@]}" load_parameters_path="$OUT/$RUN/checkpoints/$STEPS" \
    prompt="$PROMPT" max_new_tokens=48 sampling=sample temperature=0.7 top_k=20 stream=false \
    | tee "$OUT/$RUN/sample.txt"
$PY -m k3jax.plot "$OUT/$RUN"
$PY scripts/demo_words.py "$OUT/$RUN/sample.txt" --prompt "$PROMPT"
echo "demo: $(( $(date +%s) - start )) s"
