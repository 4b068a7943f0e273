"""k3jax.plot: curves.png from a run dir's metrics.jsonl; clear errors (exit 2) for bad run dirs."""
import json

import pytest

from k3jax import plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_metrics(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _records(n, start=1):
    return [{"step": s, "loss": 6.0 / s, "accuracy": 0.05 * s, "tokens_per_s": 100.0 + s,
             "tflops_per_device": 0.01 * s, "mfu": 0.001 * s} for s in range(start, start + n)]


def test_plot_writes_png(tmp_path, capsys):
    run = tmp_path / "run"
    _write_metrics(run, _records(12))
    assert plot.main([str(run)]) == 0
    png = run / "curves.png"
    data = png.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC)
    assert str(png) in capsys.readouterr().out


def test_resumed_steps_keep_the_last_record(tmp_path):
    run = tmp_path / "run"
    recs = _records(5) + [dict(r, loss=0.5) for r in _records(2, start=4)]   # steps 4, 5 redone
    _write_metrics(run, recs)
    got = plot.read_metrics(run)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert got[3]["loss"] == 0.5 and got[2]["loss"] == 2.0


@pytest.mark.parametrize("case", ["missing_dir", "missing_file", "empty_file"])
def test_bad_run_dir_exits_2_with_one_line(tmp_path, capsys, case):
    run = tmp_path / "run"
    if case != "missing_dir":
        run.mkdir()
    if case == "empty_file":
        (run / "metrics.jsonl").write_text("\n")
    assert plot.main([str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert str(run) in err
    assert not (run / "curves.png").exists()


def test_usage_error(capsys):
    assert plot.main([]) == 2
    assert "usage" in capsys.readouterr().err
