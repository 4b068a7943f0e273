#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh installs on the GPU image into .whl/ (gitignored) and print
# their total size; with the repo it must stay under the device run's 64 MiB. Run from anywhere:
#   bash scripts/gpu_wheels.sh
# NAMES is what the image lacks (or has too old) on the GPU path: scripts/gpu_imports.py, run by
# `scripts/gpu_check.sh --dry-run` in CI, fails naming any import the image and this list do not cover.
# Only names here: each version is the one uv.lock pins (scripts/lock_tool.py gpu-wheels), so the
# card runs what CI tests; gpu_imports.py checks the project venv has the same. protobuf
# travels too: xprof's generated code (tokamax imports it) needs a runtime >= 6.31, the image's is unread;
# flax too: k3jax needs >= 0.12.8 and the device docs do not give the image's version; regex too:
# transformers checks regex >= 2025.10.22 when imported.
set -euo pipefail
cd "$(dirname "$0")/.."
NAMES=(
  grain array-record portpicker tokamax qwix einshape immutabledict pydantic pydantic-core
  annotated-types typing-inspection xprof fire termcolor tensorboardX protobuf flax transformers
  huggingface-hub httpx2 httpcore2 truststore regex flash-linear-attention fla-core
)
PY=${PYTHON:-python3}
WHEELS=($("$PY" scripts/lock_tool.py gpu-wheels))
[ "${#WHEELS[@]}" -eq "${#NAMES[@]}" ] || { echo "error: ${#NAMES[@]} names, ${#WHEELS[@]} locked versions" >&2; exit 1; }
mkdir -p .whl
for w in "${WHEELS[@]}"; do
  name=${w%%==*}
  ls .whl/ | grep -qi "^$(echo "$name" | tr '-' '_')-${w##*==}-" && continue
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$w"
done
# tokamax imports xprof (its profiler bindings, xprof/convert/profiler_plugin_c_api.so) when it is
# imported; xprof's web UI assets and its events-database library (xprof/static, .../events_db) are
# never loaded then and are half the wheel: they are dropped from it (and from its RECORD), 32 -> 15 MB.
"$PY" - .whl/xprof-*.whl <<'PYEOF'
import os, sys, zipfile
src = sys.argv[1]
drop = ("xprof/static/", "xprof/convert/events_db/", "xprof/integration_tests/")
with zipfile.ZipFile(src) as zi:
    if not any(i.filename.startswith(drop) for i in zi.infolist()):
        sys.exit(0)                                     # trimmed already
    with zipfile.ZipFile(src + ".tmp", "w", zipfile.ZIP_DEFLATED) as zo:
        for info in zi.infolist():
            if info.filename.startswith(drop):
                continue
            data = zi.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(x + b"\n" for x in data.splitlines() if not x.decode().startswith(drop))
            zo.writestr(info, data)
os.replace(src + ".tmp", src)
print(f"trimmed {src}: {os.path.getsize(src) / 2**20:.1f} MiB")
PYEOF
# Keep exactly the listed wheels (a stale version would make two of one package).
keep=$(for w in "${WHEELS[@]}"; do echo "$(echo "${w%%==*}" | tr 'A-Z-' 'a-z_')-${w##*==}-"; done)
for f in .whl/*.whl; do
  b=$(basename "$f" | tr 'A-Z' 'a-z')
  echo "$keep" | grep -qF -- "$(echo "$b" | cut -d- -f1-2)-" || { echo "removing $f (not in WHEELS)"; rm -f "$f"; }
done
n=$(ls .whl/*.whl | wc -l)
[ "$n" -eq "${#WHEELS[@]}" ] || { echo "error: ${#WHEELS[@]} wheels listed, $n in .whl/" >&2; exit 1; }
whl=$(du -cb .whl/*.whl | tail -1 | cut -f1)
repo=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | grep total$ | awk '{s+=$1} END {print s}')
echo "wheels: $n files, $((whl / 1048576)) MiB ($whl bytes); tracked repo files $((repo / 1048576)) MiB; together $(((whl + repo) / 1048576)) MiB of 64"
[ $((whl + repo)) -lt $((64 * 1048576)) ] || { echo "error: wheels + repo exceed 64 MiB" >&2; exit 1; }
