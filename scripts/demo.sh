#!/usr/bin/env bash
# The main job on CPU: train the tiny K3-shaped model (base.yml defaults) on synthetic data,
# checkpoint it, then decode from the checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
PY=.venv/bin/python
RUN=${RUN:-demo}
STEPS=${STEPS:-300}
rm -rf "runs/$RUN"
$PY -m k3jax.train configs/base.yml run_name="$RUN" steps="$STEPS" per_device_batch_size=8 checkpoint_period=100 log_period=25
$PY -m k3jax.decode configs/base.yml load_parameters_path="runs/$RUN/checkpoints/$STEPS" prompt="I love to" max_new_tokens=24
