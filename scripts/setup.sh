#!/usr/bin/env bash
# Create .venv with a Python >= 3.12 found on this machine and install exactly uv.lock into it: k3jax
# editable with its dev extras, every package at the locked version and hash, whatever the registry
# serves today. Idempotent and fast when nothing changed (uv sync checks the environment against the
# lock in well under a second), so every `make demo` / `make test` also repairs a drifted .venv.
# `make lock` refreshes the lock on purpose (docs/dependencies.md).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
export UV_PYTHON_DOWNLOADS=never UV_PROJECT_ENVIRONMENT=$VENV

is_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }

find_python() {
  local c
  for c in "${PYTHON:-}" python3.12 python3.13 python3; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && is_ok "$c" && { command -v "$c"; return; }
  done
  if command -v pyenv >/dev/null 2>&1 || [ -d "$HOME/.pyenv" ]; then
    local root; root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
    for c in "$root"/versions/3.1[2-9]*/bin/python; do
      [ -x "$c" ] && is_ok "$c" && { echo "$c"; return; }
    done
  fi
  echo "error: no Python >= 3.12 found; install one or set PYTHON=/path/to/python3.12" >&2
  exit 1
}

[ -f uv.lock ] || { echo "error: uv.lock is missing; restore it (git checkout uv.lock) or run make lock" >&2; exit 1; }
if ! [ -x "$VENV/bin/python" ] || ! is_ok "$VENV/bin/python"; then
  PY=$(find_python)
  echo "setup: using $PY ($("$PY" --version))"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi
# uv itself, at the version and hashes uv.lock pins (it is in the dev extra), bootstrapped with pip.
UV_PIN=$("$VENV/bin/python" scripts/lock_tool.py uv-requirement)
if ! "$VENV/bin/uv" --version 2>/dev/null | grep -q "^uv ${UV_PIN%% *}\b"; then
  req=$(mktemp)
  "$VENV/bin/python" scripts/lock_tool.py uv-requirement --hashes > "$req"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --require-hashes --no-deps -r "$req"
  rm -f "$req"
fi
# --frozen: install the lock as it is, never re-resolve; --exact is uv's default: packages that
# are not in the lock (a hand install, a newer version) are removed or put back to the locked one.
"$VENV/bin/uv" sync -q --frozen --extra dev
"$VENV/bin/python" -c 'import k3jax' || { echo "error: k3jax does not import in $VENV" >&2; exit 1; }
