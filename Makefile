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

# --dist loadscope keeps each test module on one xdist worker, so a module-scoped fixture (a served
# model, a fine-tuning journey, test_multihost's chained pod launches) is built once, not once per
# worker as plain -n 2 can do. (--dist loadgroup would not help: with pytest 9.2 and xdist 3.8 its
# xdist_group markers never reach the node ids it groups by.)
test: setup
	$(PY) -m pytest tests -q -n 2 --dist loadscope --durations=15

bench: setup
	$(PY) benchmarks/kda.py
