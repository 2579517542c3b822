"""Lesson 6 (is it fast?): what an all-reduce costs here, as nccl-tests define it, the alpha-beta model
fitted to it, and where a DDP step's time goes (`StepBreakdown`).

Bandwidths (nccl-tests, doc/PERFORMANCE.md): algorithm bandwidth = bytes / time; bus bandwidth = algorithm
bandwidth x 2(W-1)/W for an all-reduce, the factor of a ring all-reduce, in which each rank sends and
receives 2(W-1)/W of the payload. Bus bandwidth is comparable across world sizes and with the link's
peak. The alpha-beta model: time = alpha + bytes / beta, alpha the latency of one collective and beta
the algorithm bandwidth a large payload reaches.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

RANK_SCRIPT = Path(__file__).with_name("allreduce.py")


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


# Published all-reduce bus bandwidths, for the plot: someone else's hardware, for scale, each with its conditions
# and source (NVIDIA's NCCL maintainers in the nccl and nccl-tests issue threads; the Ultra-Scale Playbook,
# huggingface.co/spaces/nanotron/ultrascale-playbook): no blog pages.
PUBLISHED_BUS_BANDWIDTH = (
    ("8 x H100, NVLink, ring", 370e9,
     "nccl-tests all-reduce bus bandwidth with the ring algorithm, about 370 GB/s, as NVIDIA's NCCL maintainers "
     "state it in nccl and nccl-tests issue threads (NVLink SHARP's in-switch reduction reaches about 480)"),
    ("64 nodes of 8 x H100", 33e9,
     "the Ultra-Scale Playbook's 'Communication Bandwidth by Number of Nodes': all-reduce of 256 MB, median, "
     "33 GB/s on 64 nodes against 436 on one (it does not say whether bus or algorithm bandwidth)"),
)


# The Ultra-Scale Playbook's data-parallel scaling (huggingface.co/spaces/nanotron/ultrascale-playbook): tokens/s
# per GPU from its `dp_scaling` figure; the two MFU values from its interactive benchmark table (the 1B, pure-DP,
# ZeRO-0 column, the same throughputs). Pure data parallelism (ZeRO-0), nodes of 8 x H100, sequence 4096, the global
# batch fixed at 1M tokens (so gradient accumulation falls from 16 steps at 8 GPUs to 1 at 256): strong scaling.
# GPUs -> (tokens/s per GPU, MFU).
PLAYBOOK_DP_SCALING = {8: (40_150, 0.392), 16: (37_610, None), 32: (35_368, None), 64: (31_112, None),
                       128: (26_446, None), 256: (15_700, 0.153)}
PLAYBOOK_CONDITIONS = ("Ultra-Scale Playbook, data parallelism: 1B model, ZeRO-0, 8 x H100 per node, sequence 4096, "
                       "global batch 1M tokens")


def training_flops_per_sample(parameters: int) -> int:
    """6 N: a dense layer's parameter is one multiply-add (2 FLOPs) per sample in the forward, and two in the
    backward (the input's gradient and its own)."""
    return 6 * parameters


MIN_TOLERANCE = 0.15  # below this, a run's spread is not a fair measure of its noise (too few repetitions)


def spread(values: list[float]) -> float:
    """The interquartile range relative to the median: how much repeated measurements of one thing vary."""
    q1, median, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / median


@dataclass(frozen=True)
class StepBreakdown:
    """One rank's backward pass, measured in one run, and the two bounds the simple model gives.

    Model: the gradients are computed in `compute_s` (a backward under `no_sync`, no communication), and
    all-reducing the buckets one after another, alone, takes `communication_s`. With no overlap the
    backward takes their sum (`serial_s`); with perfect overlap, the longer of the two (`overlapped_s`).
    Where the measured backward with DDP (`ddp_s`) lies is an observation, not a check: on CPU ranks the
    computation and gloo's threads share the cores, and it can be longer than no overlap at all.
    """

    compute_s: float
    communication_s: float
    ddp_s: float
    tolerance: float

    @property
    def serial_s(self) -> float:
        return self.compute_s + self.communication_s

    @property
    def overlapped_s(self) -> float:
        return max(self.compute_s, self.communication_s)

    @property
    def hidden_share(self) -> float:
        """The share of the communication that did not add to the backward's time."""
        return (self.serial_s - self.ddp_s) / self.communication_s

    def where_it_lies(self) -> str:
        """Where the measured backward lies against the two bounds, said as the numbers show it (an observation:
        on a shared CPU, timing is no check)."""
        ms = lambda seconds: f"{seconds * 1e3:.1f} ms"  # noqa: E731
        bounds = f"perfect overlap max(C, A) = {ms(self.overlapped_s)}, none C + A = {ms(self.serial_s)}"
        if self.ddp_s > self.serial_s:
            return (f"{ms(self.ddp_s)}, {ms(self.ddp_s - self.serial_s)} longer than no overlap at all ({bounds}): no "
                    "measurable overlap; the rest is outside the model (DDP's bucket copies, cores shared with "
                    "gloo's threads)")
        if self.ddp_s < self.overlapped_s:
            return (f"{ms(self.ddp_s)}, {ms(self.overlapped_s - self.ddp_s)} shorter than perfect overlap allows "
                    f"({bounds}): the run's noise, whose spread here is {self.tolerance:.0%}")
        return (f"{ms(self.ddp_s)}, between the bounds ({bounds}): about {self.hidden_share:.0%} of the communication "
                f"hidden, of at most {min(1.0, self.compute_s / self.communication_s):.0%} (C / A) that could be")


def step_breakdown(facts: dict) -> StepBreakdown:
    """From one rank's recorded `compute_s` and `ddp_s` (repeated backward times, without and with DDP's
    communication) and `allreduce_alone_s` (the same buckets' all-reduces, one after another, outside
    backward, once per repetition). Medians throughout; the tolerance is the largest spread of the three
    (at least MIN_TOLERANCE)."""
    spreads = (spread(facts["compute_s"]), spread(facts["ddp_s"]), spread(facts["allreduce_alone_s"]))
    return StepBreakdown(statistics.median(facts["compute_s"]), statistics.median(facts["allreduce_alone_s"]),
                         statistics.median(facts["ddp_s"]), max(MIN_TOLERANCE, *spreads))
