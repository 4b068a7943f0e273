# Two commands a new user needs (each creates .venv first if missing):
#   make demo   - the main job: train the tiny K3-shaped model on CPU, checkpoint, decode from it
#   make test   - the test suite (8 simulated CPU devices)
PY := .venv/bin/python
export JAX_PLATFORMS ?= cpu

.PHONY: setup demo test bench

setup:
	@bash scripts/setup.sh

demo: setup
	@bash scripts/demo.sh

test: setup
	$(PY) -m pytest tests -q -n 2 --durations=15

bench: setup
	$(PY) benchmarks/kda.py
