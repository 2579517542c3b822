"""Lesson 6's arithmetic (bus bandwidth as nccl-tests define it, the alpha-beta fit) and the all-reduce
benchmark run for real on CPU ranks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_helpers.lessons.lesson6 import AlphaBeta, bandwidths, fit_alpha_beta, ring_factor

ROOT = Path(__file__).resolve().parent.parent


def test_bus_bandwidth_is_the_algorithm_bandwidth_times_the_ring_factor():
    assert ring_factor(2) == 1.0 and ring_factor(4) == 1.5 and ring_factor(8) == 1.75
    [point] = bandwidths([{"bytes": 1 << 20, "seconds": 0.001}], world_size=4)
    assert point["algbw"] == pytest.approx((1 << 20) / 0.001) and point["busbw"] == pytest.approx(point["algbw"] * 1.5)


def test_the_fit_recovers_latency_and_bandwidth_from_points_that_follow_the_model():
    truth = AlphaBeta(alpha_s=50e-6, beta_bytes_per_s=2e9)
    points = [{"bytes": size, "seconds": truth.predict(size) * noise}
              for size, noise in zip([1 << k for k in range(10, 27, 2)], [1.02, 0.98, 1.01, 0.99, 1.0, 1.03, 0.97, 1.0, 1.01])]
    fit = fit_alpha_beta(points)
    assert fit.alpha_s == pytest.approx(50e-6, rel=0.1) and fit.beta_bytes_per_s == pytest.approx(2e9, rel=0.1)


def test_points_that_do_not_follow_the_model_are_refused():
    shrinking = [{"bytes": 1 << 10, "seconds": 1.0}, {"bytes": 1 << 20, "seconds": 0.001}]  # more bytes, less time
    with pytest.raises(ValueError, match="do not follow"):
        fit_alpha_beta(shrinking)


def test_the_benchmark_measures_all_reduce_on_this_machine(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "allreduce.py"), "--max-mib", "1", "--repeats", "3",
         "--json", str(tmp_path / "points.json"), "--plot", str(tmp_path / "plot.png")],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    saved = json.loads((tmp_path / "points.json").read_text())
    assert [p["bytes"] for p in saved["points"]] == [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20]
    assert all(p["seconds"] > 0 for p in saved["points"]) and saved["beta_bytes_per_s"] > 0
    assert "alpha-beta fit: latency alpha =" in done.stdout and "busbw (GB/s)" in done.stdout
    assert (tmp_path / "plot.png").stat().st_size > 10_000
