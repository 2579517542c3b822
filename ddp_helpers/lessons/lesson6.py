"""Lesson 6 (is it fast?): what an all-reduce costs here, as nccl-tests define it, and the alpha-beta model
fitted to it.

Bandwidths (nccl-tests, doc/PERFORMANCE.md): algorithm bandwidth = bytes / time; bus bandwidth = algorithm
bandwidth x 2(W-1)/W for an all-reduce, the factor of a ring all-reduce, in which each rank sends and
receives 2(W-1)/W of the payload. Bus bandwidth is comparable across world sizes and with the link's
peak. The alpha-beta model: time = alpha + bytes / beta, alpha the latency of one collective and beta
the algorithm bandwidth a large payload reaches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

RANK_SCRIPT = Path(__file__).with_name("lesson6_allreduce.py")


def ring_factor(world_size: int) -> float:
    """How much of the payload each rank sends (and receives) in a ring all-reduce, per byte."""
    return 2 * (world_size - 1) / world_size


def bandwidths(points: list[dict], world_size: int) -> list[dict]:
    """Each {"bytes", "seconds"} with its algorithm and bus bandwidth, in bytes per second."""
    return [{**point, "algbw": point["bytes"] / point["seconds"],
             "busbw": point["bytes"] / point["seconds"] * ring_factor(world_size)} for point in points]


@dataclass(frozen=True)
class AlphaBeta:
    """time = alpha + bytes / beta."""

    alpha_s: float
    beta_bytes_per_s: float

    def predict(self, size_bytes: float) -> float:
        return self.alpha_s + size_bytes / self.beta_bytes_per_s


def fit_alpha_beta(points: list[dict]) -> AlphaBeta:
    """Least squares on the relative error: small payloads (latency-bound) weigh as much as large ones
    (bandwidth-bound), which an absolute fit would let the largest payloads dominate. Refuses a fit whose
    latency or bandwidth comes out negative (the points do not follow the model)."""
    import numpy as np

    seconds = np.array([p["seconds"] for p in points], dtype=float)
    sizes = np.array([p["bytes"] for p in points], dtype=float)
    if len(points) < 2 or (seconds <= 0).any():
        raise ValueError(f"need 2 or more points with positive times to fit, got {points}")
    # (alpha + n / beta) / t = 1 for every point: linear in (alpha, 1 / beta).
    design = np.stack([1 / seconds, sizes / seconds], axis=1)
    (alpha, inverse_beta), *_ = np.linalg.lstsq(design, np.ones_like(seconds), rcond=None)
    if alpha < 0 or inverse_beta <= 0:
        raise ValueError(f"the points do not follow time = alpha + bytes / beta (alpha {alpha:.3g} s, 1/beta "
                         f"{inverse_beta:.3g} s per byte): {points}")
    return AlphaBeta(float(alpha), float(1 / inverse_beta))


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}"
        size /= 1024
    return f"{size:.0f} GiB"


def table(points: list[dict], world_size: int, fit: AlphaBeta) -> str:
    """The benchmark's table, as nccl-tests print theirs: size, time, algbw, busbw, and the model's time."""
    rows = [f"{'size':>10}  {'time (us)':>10}  {'algbw (GB/s)':>12}  {'busbw (GB/s)':>12}  {'model (us)':>10}"]
    for point in bandwidths(points, world_size):
        rows.append(f"{human_bytes(point['bytes']):>10}  {point['seconds'] * 1e6:>10.1f}  {point['algbw'] / 1e9:>12.3f}  "
                    f"{point['busbw'] / 1e9:>12.3f}  {fit.predict(point['bytes']) * 1e6:>10.1f}")
    return "\n".join(rows)


def plot_allreduce(points: list[dict], world_size: int, fit: AlphaBeta):
    """Time and bus bandwidth against payload, measured and as the fitted model predicts (log-log)."""
    import matplotlib.pyplot as plt

    from ..plots import series_color

    measured = bandwidths(points, world_size)
    sizes = [p["bytes"] for p in measured]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.loglog(sizes, [p["seconds"] * 1e6 for p in measured], "o", color=series_color(0), label="measured")
    left.loglog(sizes, [fit.predict(s) * 1e6 for s in sizes], "-", color=series_color(1),
                label=f"alpha + bytes / beta ({fit.alpha_s * 1e6:.0f} us, {fit.beta_bytes_per_s / 1e9:.2f} GB/s)")
    left.set_xlabel("payload (bytes)")
    left.set_ylabel("time (us)")
    left.legend(fontsize=8, frameon=False)
    right.semilogx(sizes, [p["busbw"] / 1e9 for p in measured], "o-", color=series_color(0), label="measured")
    right.semilogx(sizes, [s / fit.predict(s) * ring_factor(world_size) / 1e9 for s in sizes], "-",
                   color=series_color(1), label="model")
    right.set_xlabel("payload (bytes)")
    right.set_ylabel("bus bandwidth (GB/s)")
    right.legend(fontsize=8, frameon=False)
    fig.suptitle(f"all_reduce on {world_size} ranks", fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    return fig
