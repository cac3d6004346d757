"""Start-up measurements for the time-based cost model, agreed across ranks.

The link is timed with the engine's own collectives (allgather of bytes, allreduce of floats)
at two sizes each; every rank then shares its figures and takes the element-wise maximum, so
all ranks decide from the same numbers. Collectives are started in the same order with the same
names on every rank, at the same step.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .. import costmodel

SMALL_BYTES = 64
LARGE_BYTES = 4 << 20


def _timed(fn, reps):
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_link(transport, device, reps: int = 3) -> list:
    """This rank's [gather small, gather large, reduce small, reduce large] seconds."""
    out = []
    for kind in ("gather", "reduce"):
        for nbytes in (SMALL_BYTES, LARGE_BYTES):
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


def agree_max(transport, values) -> np.ndarray:
    """The element-wise maximum over ranks of a list of floats."""
    local = torch.tensor(list(values), dtype=torch.float64)
    raw = local.view(torch.uint8)
    got = transport.wait(transport.allgather_async(raw, "hvd_sparse.calibrate.agree")).cpu()
    table = got.view(torch.float64).view(transport.size(), len(values)).numpy()
    return table.max(axis=0)


def link_from(times, world_size: int) -> costmodel.Link:
    """Fit a :class:`~hvd_sparse.costmodel.Link` to the agreed timings."""
    g_small, g_large, r_small, r_large = times
    g_lat, g_bw = costmodel.fit_line(world_size * SMALL_BYTES, g_small,
                                     world_size * LARGE_BYTES, g_large)
    r_lat, r_bw = costmodel.fit_line(SMALL_BYTES, r_small, LARGE_BYTES, r_large)
    return costmodel.Link(g_lat, g_bw, r_lat, r_bw)
