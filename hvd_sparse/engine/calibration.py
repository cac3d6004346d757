"""Start-up measurements for the time-based cost model, agreed across ranks.

The link is timed with the engine's own collectives (allgather of bytes, allreduce of floats)
at two sizes each; every rank then shares its figures and takes the element-wise maximum, so
all ranks decide from the same numbers. Collectives are started in the same order with the same
names on every rank, at the same step.

The large size starts at 4 MiB, or at the largest bucket where that is smaller (nothing larger
is ever priced), and grows (x4, up to the largest bucket) until its transfer takes at least
``DOMINATES`` times the small one. Below that the fixed cost hides the bandwidth: Horovod
starts collectives on a cycle (5 ms in the training CLI), back-to-back timings lock onto it,
and a 4 MiB allreduce on a fast link measured exactly one cycle, as did 64 bytes; the fit then
read an unbounded bandwidth and priced a 36 MB dense bucket at 5 ms (loopback, 2 ranks).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .. import costmodel, golomb

SMALL_BYTES = 64
LARGE_BYTES = 4 << 20


def _timed(fn, reps):
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


#: the large transfer must take this many times the small one before the fit is trusted
DOMINATES = 3.0
#: the large size never grows past this (nor past the largest bucket)
MAX_LARGE_BYTES = 64 << 20
#: nor starts below this: a model whose buckets are all smaller is priced at its own sizes
#: (4 MiB probes were 33.5 MB per rank, 90% of a 31k-parameter GRU's whole dense run)
MIN_LARGE_BYTES = 64 << 10


#: timed repetitions of each probe (after one warm-up)
REPS = 3


def probe_bytes(large_bytes: int) -> int:
    """What one :func:`measure_link` sends from this rank: each of its four probes (allgather
    and allreduce, small and large) once to warm up and ``REPS`` times timed."""
    return (REPS + 1) * 2 * (SMALL_BYTES + large_bytes)


def measure_link(transport, device, large_bytes: int = LARGE_BYTES, reps: int = REPS) -> list:
    """This rank's [gather small, gather large, reduce small, reduce large] seconds."""
    out = []
    for kind in ("gather", "reduce"):
        for nbytes in (SMALL_BYTES, large_bytes):
            if kind == "gather":
                buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)

                def run(buf=buf, nbytes=nbytes):
                    transport.wait(transport.allgather_async(
                        buf, f"hvd_sparse.calibrate.gather.{nbytes}"))
            else:
                buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)

                def run(buf=buf, nbytes=nbytes):
                    transport.wait(transport.allreduce_async(
                        buf, f"hvd_sparse.calibrate.reduce.{nbytes}", average=False))
            run()  # warm-up: buffers, connections, fusion
            out.append(_timed(run, reps))
    return out


def agreed_link(transport, device, largest_bucket_bytes: int):
    """The agreed timings, the large size they were taken at and the probe bytes this rank
    sent: ``(times, large_bytes, sent)``. Every rank grows the size on the same agreed
    figures, so all stop together."""
    cap = max(MIN_LARGE_BYTES, min(MAX_LARGE_BYTES, int(largest_bucket_bytes)))
    large, sent = min(LARGE_BYTES, cap), 0
    while True:
        times = agree_max(transport, measure_link(transport, device, large),
                          f"hvd_sparse.calibrate.link.{large}")
        sent += probe_bytes(large)
        g_small, g_large, r_small, r_large = times
        if large >= cap or (g_large >= DOMINATES * g_small and r_large >= DOMINATES * r_small):
            return times, large, sent
        large = min(cap, large * 4)


def agree_max(transport, values, name: str = "hvd_sparse.calibrate.agree") -> np.ndarray:
    """The element-wise maximum over ranks of a list of floats."""
    local = torch.tensor(list(values), dtype=torch.float64)
    raw = local.view(torch.uint8)
    got = transport.wait(transport.allgather_async(raw, name)).cpu()
    table = got.view(torch.float64).view(transport.size(), len(values)).numpy()
    return table.max(axis=0)


def link_from(times, world_size: int, large_bytes: int = LARGE_BYTES) -> costmodel.Link:
    """Fit a :class:`~hvd_sparse.costmodel.Link` to the agreed timings."""
    g_small, g_large, r_small, r_large = times
    g_lat, g_bw = costmodel.fit_line(world_size * SMALL_BYTES, g_small,
                                     world_size * large_bytes, g_large)
    r_lat, r_bw = costmodel.fit_line(SMALL_BYTES, r_small, large_bytes, r_large)
    return costmodel.Link(g_lat, g_bw, r_lat, r_bw)


#: how many positions the codec is timed on (about what a 10M-entry bucket sends at 1%)
CODEC_POSITIONS = 1 << 16


def measure_codec(density: float, count: int = CODEC_POSITIONS, reps: int = 3) -> list:
    """This rank's [encode, decode] seconds per position of the Golomb-Rice position code at
    ``density`` (CPU), on positions drawn as the code expects them (geometric gaps; the same
    draw on every rank)."""
    density = min(max(float(density), 1e-6), 0.5)
    gaps = np.random.default_rng(0).geometric(density, size=count)
    positions = torch.from_numpy(np.cumsum(gaps) - 1)
    b = golomb.optimal_parameter(density)
    data = golomb.encode_tensor(positions, b).numpy().tobytes()
    golomb.decode(data, count, b)  # warm-up (compiled code loaded)
    enc = _timed(lambda: golomb.encode_tensor(positions, b), reps)
    dec = _timed(lambda: golomb.decode(data, count, b), reps)
    return [enc / count, dec / count]
