"""Loss and throughput curves of a run: ``python -m k3jax.plot <run dir>`` -> ``<run dir>/curves.png``.

Reads ``<run dir>/metrics.jsonl`` (one JSON object per step, written by ``k3jax.metrics.
MetricsWriter``) and draws loss (and accuracy when logged) against step, and tokens/s with model
TFLOP/s per device against step. A resumed run appends to the same file, so a step can appear
twice (the steps redone after the last checkpoint); the later record's values win, as they are the
ones the surviving run produced. Evaluation metrics (``eval_loss``, ``eval_accuracy``, HellaSwag
accuracy), logged at the steps that ran an evaluation, are drawn as points over the training curves. Uses matplotlib's Agg backend: no display needed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from k3jax.errors import UserError, guard


class PlotError(UserError, RuntimeError):
    """A run dir that cannot be plotted (missing, no metrics.jsonl, no records)."""


def read_metrics(run_dir: str | Path) -> list[dict]:
    """metrics.jsonl records sorted by step, one per step (the last written wins)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PlotError(f"run dir {run_dir} does not exist")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path} does not exist (is {run_dir} a k3jax.train run dir?)")
    by_step = {}
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise PlotError(f"{path}:{i}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict) or "step" not in rec:
            raise PlotError(f"{path}:{i}: a record without a 'step'")
        by_step.setdefault(int(rec["step"]), {}).update(rec)
    if not by_step:
        raise PlotError(f"{path} is empty: no steps logged yet")
    return [by_step[s] for s in sorted(by_step)]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the curves of ``run_dir`` to ``out`` (default ``<run dir>/curves.png``); returns the path."""
    import matplotlib  # optional (the dev extra): only drawing curves needs it
    matplotlib.use("Agg")  # before pyplot: headless hosts and CI have no display
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig, (ax_loss, ax_tput) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    steps, loss = _series(records, "loss")
    ax_loss.plot(steps, loss, color="tab:blue", label="loss")
    ax_loss.set_ylabel("loss")
    ax_loss.grid(alpha=0.3)
    steps_e, eval_loss = _series(records, "eval_loss")
    if eval_loss:
        ax_loss.plot(steps_e, eval_loss, "o-", color="tab:purple", label="eval loss")
    steps_a, acc = _series(records, "accuracy")
    if acc:
        twin = ax_loss.twinx()
        twin.plot(steps_a, acc, color="tab:green", alpha=0.6, label="accuracy")
        for key, style, color in (("eval_accuracy", "s--", "tab:olive"), ("eval_hellaswag_accuracy", "^--", "tab:brown")):
            steps_k, vals = _series(records, key)
            if vals:
                twin.plot(steps_k, vals, style, color=color, label=key.replace("_", " "))
        twin.set_ylabel("accuracy")
        twin.legend(loc="upper right", fontsize=8)
    ax_loss.legend(loc="upper left", fontsize=8)
    ax_loss.set_title(f"{Path(run_dir).resolve().name}: {len(records)} steps, loss "
                      f"{loss[0]:.4g} -> {loss[-1]:.4g}" if loss else Path(run_dir).resolve().name)

    # Step 1 includes compilation: its throughput is a meaningless outlier that would flatten the
    # axis, so the throughput panel starts at the second record when there is one.
    tput = records[1:] if len(records) > 1 else records
    steps_t, tok = _series(tput, "tokens_per_s")
    ax_tput.plot(steps_t, tok, color="tab:orange", label="tokens/s")
    ax_tput.set_ylabel("tokens/s")
    ax_tput.set_xlabel("step")
    ax_tput.grid(alpha=0.3)
    steps_f, tf = _series(tput, "tflops_per_device")
    if tf:
        twin = ax_tput.twinx()
        twin.plot(steps_f, tf, color="tab:red", alpha=0.6, label="TFLOP/s per device")
        twin.set_ylabel("model TFLOP/s per device")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m k3jax.plot <run dir>   (writes <run dir>/curves.png)", file=sys.stderr)
        return 2
    return guard(lambda: print(f"wrote {plot_run(argv[0])}"))


if __name__ == "__main__":
    raise SystemExit(main())
