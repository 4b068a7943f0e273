"""``python -m k3jax.rl``: see k3jax.rl.loop."""
from __future__ import annotations

from k3jax.cli import run_tool
from k3jax.rl.loop import __doc__ as DOC
from k3jax.rl.loop import run


def _run(cfg) -> int:
    run(cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_tool("rl", _run, argv, DOC, local_devices=True)


if __name__ == "__main__":
    raise SystemExit(main())
