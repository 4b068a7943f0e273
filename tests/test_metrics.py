"""The CPU matmul 'peak' behind MFU: best of several timed runs, with their spread."""
from k3jax.metrics import measure_cpu_matmul_peak, measure_cpu_matmul_tflops


def test_cpu_peak_is_the_best_of_its_runs_with_the_spread():
    p = measure_cpu_matmul_peak(n=128, runs=3, seconds=0.05)
    assert len(p["runs_tflops"]) == 3 and all(r > 0 for r in p["runs_tflops"])
    assert p["tflops"] == max(p["runs_tflops"])
    assert p["spread"] == (max(p["runs_tflops"]) - min(p["runs_tflops"])) / max(p["runs_tflops"])
    assert 0 <= p["spread"] < 1 and (p["n"], p["seconds"]) == (128, 0.05)
    assert measure_cpu_matmul_tflops(n=128, runs=1, seconds=0.02) > 0
