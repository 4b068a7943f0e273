#!/usr/bin/env bash
# Create .venv with a Python >= 3.12 found on this machine and install k3jax editable with its
# dev extras. Idempotent: a second run only checks a stamp and returns.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
STAMP=$VENV/.k3jax-installed

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

if [ -f "$STAMP" ] && [ "$STAMP" -nt setup.py ] && "$VENV/bin/python" -c 'import k3jax' 2>/dev/null; then
  exit 0
fi
PY=$(find_python)
echo "setup: using $PY ($("$PY" --version))"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[dev]"
touch "$STAMP"
echo "setup: .venv ready"
