#!/usr/bin/env bash
# k3jax on one NVIDIA GPU in at most 5 minutes (issue 38): each part's JSON lands in OUT_DIR as soon as
# that part is done, and a part that fails or runs out of its time does not stop the others.
#
# The device run (this workplace's device tool), prepared here first with `bash scripts/gpu_wheels.sh`:
#   run(command="bash scripts/gpu_check.sh $OUT", carry=[".whl"], timeout_s=420)
# The CPU dry run (CI runs it: tests/test_gpu_check.py):
#   bash scripts/gpu_check.sh --dry-run /tmp/gpu_check_dry
#
# Parts, in this order, each under `timeout` (seconds: its own budget, cut to what is left of 300;
# install ~20 s first):
#   a  tests.json        the one-device numerics tests below on the card, f32 and bf16 (35 s)
#   e  ragged_dot_lowering.json  benchmarks/ragged_dot_lowering.py --gpu: does XLA's GPU lowering of
#                        ragged_dot (moe_impl=auto there) run every expert on every row? (20 s)
#   b  train_step.json   benchmarks/train_step.py --gpu: k3-slice and small, bf16, remat none and full,
#                        tokens/s and MFU, median of steps 3-10; rewritten after each row (80 s)
#   c  kda.json          benchmarks/kda.py --gpu: k3jax's chunked KDA, B=1 H=16 K=V=128, T 2048 / 8192,
#      kda_fla.json      bf16, inputs and outputs saved; then benchmarks/kda_fla.py: fla's chunk_kda
#                        on the same inputs in a torch process, timed and compared (25 + 45 s)
#   d  decode_vs_hf.json benchmarks/decode_vs_hf.py --gpu: greedy decode, k3jax vs transformers,
#                        batch 1 / 8 / 32, tokens in f32, speed in bf16 (75 s)
#   gpu_check.json       every part's exit code and seconds (rewritten after each part); all output
#                        goes to gpu_check.log (8 files at most come back from a device run)
# --dry-run: the same JAX parts on the host CPU at tiny sizes, no wheels; the torch parts (fla,
# transformers) are skipped, the test list is only collected, and scripts/gpu_imports.py checks
# that the wheel list covers every import of the GPU path.
set -u
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
[ $# -eq 1 ] || { echo "usage: scripts/gpu_check.sh [--dry-run] OUT_DIR" >&2; exit 2; }
mkdir -p "$1" && OUT=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
BUDGET=${GPU_CHECK_BUDGET_S:-$([ $DRY = 1 ] && echo 900 || echo 300)}  # the dry run: a slow CI host, cold caches
START=$SECONDS
WORK=$(mktemp -d /tmp/k3jax_gpu_check.XXXXXX)
LOG=$OUT/gpu_check.log
: > "$LOG"
STATUS=()

# The one-device numerics tests (tests/conftest.py honours JAX_PLATFORMS and K3JAX_TEST_HOST_DEVICES),
# 50 with megablox (the TPU Pallas kernel) left out, in the order they run: the whole model first, so a
# part cut by its time still has them.
TESTS=(
  tests/test_gpu_check.py::test_bf16_forward_matches_float32
  tests/test_model.py::test_matches_float64_reference
  tests/test_model.py::test_prefill_then_decode_equals_full_forward
  tests/test_kda_chunked.py::test_chunked_matches_reference
  tests/test_kda_chunked.py::test_bounded_form_matches_reference
  tests/test_kda_chunked.py::test_bounded_form_choice_and_float64
  tests/test_kda_chunked.py::test_split_calls_carry_the_state
  tests/test_kda_reference.py
  tests/test_kda_decode.py::test_decode_steps_equal_chunked_forward
  tests/test_moe_kernels.py::test_moe_matches_dense_reference_bf16
  tests/test_moe_kernels.py::test_few_token_dispatch_matches_dropless
  tests/test_moe_kernels.py::test_grouped_matmul_matches_numpy
  tests/test_moe_kernels.py::test_tokamax_ragged_dot_equals_ragged_dot
)
TEST_FILTER="not megablox"

if [ $DRY = 1 ]; then
  PY=${PYTHON:-.venv/bin/python}
  [ -x "$PY" ] || PY=python3
  export JAX_PLATFORMS=cpu
else
  PY=${PYTHON:-python3}
  export PYTHONUNBUFFERED=1
  t0=$SECONDS
  irc=0
  # The device README's install line: the carried wheels into /tmp/site, ahead of the image's packages.
  if timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl >>"$LOG" 2>&1; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    irc=1
    echo "error: installing .whl/*.whl failed (see $LOG); carry .whl made by scripts/gpu_wheels.sh" | tee -a "$LOG"
  fi
  # No index there, so no build isolation: the image's setuptools builds the editable install.
  if ! timeout 60 "$PY" -m pip install -q -e . --no-deps --no-build-isolation >>"$LOG" 2>&1; then
    echo "note: pip install -e . failed (see $LOG); using src/ and the repo root on PYTHONPATH" | tee -a "$LOG"
    export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
  timeout 60 "$PY" - >>"$LOG" 2>&1 <<'EOF'
import importlib.metadata as md
for d in ("jax", "jaxlib", "flax", "optax", "grain", "tokamax", "transformers", "huggingface-hub", "torch", "triton",
          "fla-core"):
    try:
        print(f"{d} {md.version(d)}")
    except md.PackageNotFoundError:
        print(f"{d} MISSING")
import jax
print("jax devices:", jax.devices())
EOF
  timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$LOG" 2>&1
  STATUS+=("install:$irc:$((SECONDS - t0))")
  echo "install: rc $irc, $((SECONDS - t0)) s"
fi

write_status() {
  "$PY" - "$OUT/gpu_check.json" "$DRY" "${STATUS[@]}" <<'EOF'
import json, sys
path, dry, *parts = sys.argv[1:]
rows = [dict(zip(("part", "rc", "seconds"), p.split(":"))) for p in parts]
for r in rows:
    r["rc"], r["seconds"] = int(r["rc"]), int(r["seconds"])
json.dump({"dry_run": dry == "1", "parts": rows, "ok": all(r["rc"] == 0 for r in rows)}, open(path, "w"), indent=2)
EOF
}

# part NAME BUDGET_S CMD...: run CMD under timeout (its budget, cut to what is left), log and record it.
part() {
  local name=$1 budget=$2; shift 2
  local left=$((BUDGET - (SECONDS - START)))
  [ "$budget" -gt "$left" ] && budget=$left
  if [ "$budget" -lt 10 ]; then
    echo "$name: skipped, no time left" | tee -a "$LOG"
    STATUS+=("$name:124:0"); write_status; return
  fi
  local t0=$SECONDS
  echo "===== $name ($budget s): $*" >>"$LOG"
  timeout -k 5 "$budget" "$@" >>"$LOG" 2>&1
  local rc=$?
  STATUS+=("$name:$rc:$((SECONDS - t0))")
  write_status
  echo "$name: rc $rc, $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (timed out)')"
}

# a: the one-device numerics tests (dry run: collected only, so a renamed test fails CI)
tests_json() {
  "$PY" - "$WORK/tests.log" "$OUT/tests.json" "$@" <<'EOF'
import json, re, sys
log, out, *names = sys.argv[1:]
rows = [{"test": m.group(1), "outcome": m.group(2)} for m in
        re.finditer(r"^(tests/\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", open(log).read(), re.M)]
counts = {o: sum(r["outcome"] == o for r in rows) for o in sorted({r["outcome"] for r in rows})}
json.dump({"list": names, "counts": counts, "rows": rows}, open(out, "w"), indent=2)
print("tests:", counts)
EOF
}
if [ $DRY = 1 ]; then
  part tests 60 "$PY" -m pytest --collect-only -q -p no:cacheprovider -k "$TEST_FILTER" "${TESTS[@]}"
else
  part tests 35 env JAX_PLATFORMS=cuda K3JAX_TEST_HOST_DEVICES=1 "$PY" -m pytest -v -p no:cacheprovider \
    -k "$TEST_FILTER" "${TESTS[@]}"
fi
if [ $DRY = 0 ]; then
  grep -E "^tests/\S+ (PASSED|FAILED|ERROR|SKIPPED)" "$LOG" > "$WORK/tests.log" 2>/dev/null
  tests_json "${TESTS[@]}" | tee -a "$LOG"
fi

# e: the MoE's grouped matmul as the backend lowers it (CPU's known answer in the dry run: every group
# on every row, which is why moe_impl=auto is blocked there)
if [ $DRY = 1 ]; then
  part ragged_dot_lowering 60 "$PY" benchmarks/ragged_dot_lowering.py --gpu --dry-run --rows 256 --dims 64 64 \
    --groups 16 --repeats 2 --out "$OUT/ragged_dot_lowering.json"
else
  part ragged_dot_lowering 20 "$PY" benchmarks/ragged_dot_lowering.py --gpu --out "$OUT/ragged_dot_lowering.json"
fi

# b: train step
if [ $DRY = 1 ]; then
  part k3_slice_config 30 "$PY" -m k3jax.config configs/base.yml model_name=k3-slice
  grep -q "parameters: total 4.88B" "$LOG" || { echo "error: k3-slice is not 4.88B parameters"; STATUS+=("k3_slice_params:1:0"); }
  part train_step 120 "$PY" benchmarks/train_step.py --gpu --dry-run --config tiny --remat none --warmup 1 --repeats 1 \
    --set per_device_batch_size=1 max_target_length=32 num_layers=4 "mla_extra_layers=[]" attn_res_block_size=4 \
    --out "$OUT/train_step.json"
else
  part train_step 80 "$PY" benchmarks/train_step.py --gpu --out "$OUT/train_step.json"
fi

# c: KDA, k3jax then fla (separate processes: JAX holds most of the card while it lives)
if [ $DRY = 1 ]; then
  part kda 90 "$PY" benchmarks/kda.py --gpu --dry-run --lengths 64 --heads 2 --dim 16 --chunk 16 --repeats 1 \
    --save-io "$WORK/kda_io" --out "$OUT/kda.json"
  echo "kda_fla: skipped (dry run: torch and fla are not installed here)" | tee -a "$LOG"
else
  part kda 25 "$PY" benchmarks/kda.py --gpu --save-io "$WORK/kda_io" --out "$OUT/kda.json"
  part kda_fla 45 "$PY" benchmarks/kda_fla.py "$WORK/kda_io" --kda-json "$OUT/kda.json" --out "$OUT/kda_fla.json"
fi
rm -rf "$WORK/kda_io"

# d: decode vs transformers
if [ $DRY = 1 ]; then
  part decode 120 "$PY" benchmarks/decode_vs_hf.py --gpu --dry-run --hf-model tests/assets/kimi_linear_formats/original \
    --work "$WORK/decode" --batch 2 --prompt-len 8 --new-tokens 3 --rounds 1 --out "$OUT/decode_vs_hf.json"
else
  part decode 75 "$PY" benchmarks/decode_vs_hf.py --gpu --work "$WORK/decode" --rounds 1 --out "$OUT/decode_vs_hf.json"
fi

# The wheel list against every import of the GPU path (the benchmark scripts, the test list).
if [ $DRY = 1 ]; then
  files=(benchmarks/train_step.py benchmarks/kda.py benchmarks/kda_fla.py benchmarks/decode_vs_hf.py
         benchmarks/ragged_dot_lowering.py
         benchmarks/hf_decode_side.py tests/conftest.py tests/helpers.py)
  for t in "${TESTS[@]}"; do files+=("${t%%::*}"); done
  part imports 60 "$PY" scripts/gpu_imports.py $(printf '%s\n' "${files[@]}" | sort -u)
  awk '/^===== imports/ {f = 1; next} f' "$LOG"
fi
rm -rf "$WORK"
echo "total: $((SECONDS - START)) s; parts in $OUT/gpu_check.json, output in $LOG"
"$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d['ok'] else 1)" "$OUT/gpu_check.json"
