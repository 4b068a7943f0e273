# Two commands a new user needs (each creates .venv first if missing):
#   make demo   - the main job: train the tiny K3-shaped model on CPU, checkpoint, decode from it
#   make test   - the test suite (8 simulated CPU devices)
# Both install exactly uv.lock into .venv (scripts/setup.sh); `make lock` refreshes the lock.
PY := .venv/bin/python
# No JAX_PLATFORMS here: on a host without a TPU, import k3jax picks the CPU itself (README).

.PHONY: setup demo test bench lock

setup:
	@bash scripts/setup.sh

demo: setup
	@bash scripts/demo.sh

# --dist worksteal hands each xdist worker a contiguous half of the tests and steals from the end of
# the busier one, so a module's tests mostly stay on one worker and its module-scoped fixture (a
# served model, a fine-tuning journey) is built once (a steal can still split a module), where plain
# -n 2 built the journey on both workers. Measured from a cold cache on one host:
# worksteal 1065 s, plain 1068 s, loadscope 1128 / 1326 s (one module per worker leaves a long tail).
# (--dist loadgroup does nothing here: with pytest 9.2 and xdist 3.8 its groups never form.)
test: setup
	$(PY) -m pytest tests -q -n 2 --dist worksteal

# Refresh uv.lock on purpose: every package to the newest version setup.py's ranges allow (today's
# registry), then check it against those ranges; commit it after `make test` passes on it
# (docs/dependencies.md). `make lock P=name` moves that one package only.
lock: setup
	.venv/bin/uv lock $(if $(P),--upgrade-package $(P),--upgrade)
	$(PY) scripts/lock_tool.py check
	@bash scripts/setup.sh

bench: setup
	$(PY) benchmarks/kda.py
