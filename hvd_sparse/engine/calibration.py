"""The time-based cost model's measurements, taken at the calibration step (the end of the
first ``calibration_steps``, and every ``recalibrate_every`` after) and agreed across ranks.

The link is timed with the engine's own collectives (allgather of bytes, allreduce of floats)
at two sizes each; every rank then shares its figures and takes the element-wise maximum, so
all ranks decide from the same numbers. Collectives are started in the same order with the same
names on every rank, at the same step.

The large size starts at 4 MiB, or at the largest bucket where that is smaller (nothing larger
is ever priced), and grows (x4, up to the largest bucket) until its transfer takes at least
``DOMINATES`` times the small one. Below that the fixed cost hides the bandwidth: Horovod
starts collectives on a cycle (HOROVOD_CYCLE_TIME), back-to-back timings lock onto it,
and a 4 MiB allreduce on a fast link measured exactly one cycle, as did 64 bytes; the fit then
read an unbounded bandwidth and priced a 36 MB dense bucket at 5 ms (loopback, 2 ranks).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .. import costmodel, golomb, safety
from ..aggregation import accumulation_dtype
from ..kernels import cpu
from . import dense_regions, sharded

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


def agree_max(transport, values, name: str = "hvd_sparse.calibrate.agree",
              fingerprint: bytes = b"") -> np.ndarray:
    """The element-wise maximum over ranks of a list of floats (``fingerprint``: the
    optimizer's, checked to be the same on every rank)."""
    n = len(fingerprint)
    mine = fingerprint + np.asarray(list(values), dtype=np.float64).tobytes()
    got = safety._gather_bytes(transport, mine, name)
    safety.check_same_exchange([g[:n] for g in got], "cost model's calibration")
    table = np.stack([np.frombuffer(g[n:], dtype=np.float64) for g in got])
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


class LinkPricing:
    """The :class:`~hvd_sparse.engine.pipeline.Engine` methods of the time cost model: what
    is measured per step, when it calibrates, and the per-bucket choices."""

    def _note_wire(self, b, gathered_bytes, positions) -> None:
        w = self._wire.setdefault(b.index, [0, 0, 0])
        w[0] += gathered_bytes
        w[1] += positions
        w[2] += 1

    def _at_target_density(self) -> bool:
        """This step runs at the configured densities (not on the warm-up's or the
        cool-down's schedule): only such steps are measured for the cost model. A step of the
        density warm-up sends up to all of a bucket and costs as much; measured there (at the
        third step, 83% at 1% over a 47-step warm-up), every bucket of the 11.4M MLP was
        priced dense for the rest of the run at 1 Gbit/s."""
        c = self.config
        return self.densities() == (c.density, c.downlink_density)

    def calibration_step(self) -> int:
        """The step count at which the time cost model calibrates: after the dense warm-up
        and the density warm-up, ``calibration_steps`` steps at the configured density."""
        c = self.config
        warm, tau = max(c.dense_warmup_steps, c.density_warmup_steps), c.local_steps
        # the first exchange past the warm-ups (under local_steps, the first whose optimizer
        # step, tau * (j + 1) - 1, reaches them)
        first = warm if tau == 1 else max(0, -(-(warm + 1) // tau) - 1)
        return first + c.calibration_steps

    def calibrate(self) -> None:
        """Time the link, agree on every measurement (maximum over ranks), then choose per
        bucket from time (own compute + allgather against a dense allreduce): sparse or dense,
        and under ``index_coding="auto"`` plain or Golomb-Rice positions (codec time against
        the wire time the shorter positions save)."""
        c = self.config
        size = self.transport.size()
        device = self.buckets[0].params[0].device if self.buckets else "cpu"
        sparse = [b for b in self.buckets if b.sparse]
        n = len(sparse)
        local = [self._measured.get(b.index, 0.0) for b in sparse]
        wire = [self._wire.get(b.index, [0, 0, 1]) for b in sparse]
        local += [w[0] / w[2] for w in wire]  # per exchange, on average
        local += [w[1] / w[2] for w in wire]
        # (the code is priced where numba codes it: without it the walk is a Python loop)
        coding = c.index_coding == "auto" and torch.device(device).type == "cpu" and n > 0 \
            and cpu.available()
        if coding:
            local += measure_codec(c.density)
        # first (its fingerprint check stops ranks calibrating different optimizers before
        # their link probes, of sizes set by each optimizer's buckets, could wait on each other)
        agreed = agree_max(self.transport, local, fingerprint=self.fingerprint)
        times, large, probes = agreed_link(
            self.transport, device, max((b.nbytes for b in self.buckets), default=0))
        self.link = link_from(times, size, large)
        self.stats.totals["calibration_bytes"] += probes  # not part of any step's exchange
        compute, gathered, entries = agreed[:n], agreed[n:2 * n], agreed[2 * n:3 * n]
        self.codec = [float(x) for x in agreed[3 * n:]] if coding else None
        by = "gather" if (c.deterministic_dense and size > 2) else "reduce"
        # tensors that are always dense (small ones, below min_sparse_numel) make an allreduce
        # every step, and where the transport fuses allreduces (Horovod) a bucket joining them
        # pays its bytes but no latency of its own: pricing that latency sent a ResNet's 147 kB
        # layer sparse, into a collective of its own, and its step was 9% slower than dense
        # Horovod's (docs/results.md)
        fused = by == "reduce" and self.transport.fuses_allreduces \
            and any(not b.sparse for b in self.buckets)
        # the owners' selections against one payload: a downlink selection keeps about
        # downlink_density of the bucket; without one an owner sends every entry its region's
        # sum holds, up to P payloads' worth in all (the ranks' choices need not overlap)
        ratio = c.downlink_density / c.density if c.bidirectional else float(size)
        for b, cs, nbytes, count in zip(sparse, compute, gathered, entries):
            st = self.state[b.index]
            if cs <= 0 and st.costs.get("gathered_bytes"):
                # not measured in this process (resumed, or the world changed, while dense):
                # the last measurement, saved with the choices (as plain positions), its bytes
                # scaled to this world's number of payloads
                cs = st.costs["compute_s"]
                if nbytes <= 0:
                    scale = size / st.costs.get("world", size)
                    nbytes = st.costs["gathered_bytes"] * scale
                    count = st.costs.get("entries", 0.0) * scale
                    self._measured_coding.pop(b.index, None)
            if nbytes <= 0:  # never went sparse: no measurement, keep the current choice
                continue
            cs_golomb = bytes_golomb = None
            if coding and count > 0:
                codec_s, _, saved = costmodel.golomb_trade(
                    count, size, b.numel, b.index_dtype.itemsize, *self.codec, self.link)
                if self._measured_coding.get(b.index) == "golomb":  # its share out
                    cs, nbytes = max(0.0, cs - codec_s), nbytes + saved
                cs_golomb, bytes_golomb = cs + codec_s, nbytes - saved
            t_gather = costmodel.sparse_time(cs, nbytes, self.link)
            t_golomb = None if cs_golomb is None else \
                costmodel.sparse_time(cs_golomb, bytes_golomb, self.link)
            hist = sharded.HISTOGRAM_TENSOR_BYTES if self._global_rule(b) else 0
            t_sharded = costmodel.sharded_time(cs, nbytes / size, size, self.link, ratio, hist)
            recode = False
            if coding:
                choice = "golomb" if t_golomb is not None and t_golomb < t_gather else "plain"
                recode, st.index_coding = choice != st.index_coding, choice
                if choice == "golomb":
                    t_gather = t_golomb
            if c.collective == "auto":
                self._set_collective(b, "sharded" if t_sharded < t_gather
                                     and not self._exact_by_allgather(b) else "allgather")
            t_sparse = t_sharded if self.collective(b) == "sharded" else t_gather
            form, wire_bytes, sums_bytes = self._dense_form(b, by, size)
            t_dense = costmodel.dense_time(wire_bytes if form == "regions" else b.nbytes, size,
                                           self.link, form, fused, sums_bytes)
            st.mode = "dense" if t_dense < t_sparse or self.dense_only else "sparse"
            if recode and st.mode == "sparse":  # measured anew under its new code (a bucket
                # gone dense keeps what it was seen doing, for a later recalibration)
                for seen in (self._measured, self._wire):
                    seen.pop(b.index, None)
            if st.mode == "dense" and self.collective(b) == "sharded":
                # the first dense exchange flushes the downlink residual: it must be whole
                self._regions_to_replicated(b)
            # plain floats (the agreed measurements come as numpy's): the costs are replicated
            # state, digested by repr and sent through torch.load(weights_only=True)
            st.costs = {"sparse_s": float(t_sparse), "dense_s": float(t_dense),
                        "compute_s": float(cs), "gathered_bytes": float(nbytes),
                        "entries": float(count), "world": float(size),
                        "allgather_s": float(t_gather), "sharded_s": float(t_sharded),
                        "collective": self.collective(b), "index_coding": self.index_coding(b)}
            if t_golomb is not None:
                st.costs["golomb_allgather_s"] = float(t_golomb)
        self.calibrated_at = self.steps
        self.calibrated_world = size

    def _dense_form(self, b, by: str, size: int) -> tuple:
        """How a dense bucket of gradients goes, for its price: ``(by, wire bytes, sums'
        bytes)``, ``by`` turned ``"regions"`` where a gather is summed region by region
        (:mod:`~hvd_sparse.engine.dense_regions`; the sums in the accumulation dtype)."""
        items = self.__dict__.setdefault("_wire_itemsizes", {})  # (the bytes rule asks per step)
        if b.dtype not in items:
            items[b.dtype] = self.config.compression.compress(
                torch.zeros(1, dtype=b.dtype))[0].element_size()
        item = items[b.dtype]
        acc = accumulation_dtype(b.dtype).itemsize
        if by == "gather" and dense_regions.applies(self.transport, size, b.numel * item,
                                                    item, acc):
            return "regions", b.numel * item, b.numel * acc
        return by, b.numel * item, None

    def cost_report(self) -> dict:
        """The cost model's inputs and choices (part of ``communication_stats()``)."""
        return {"rule": self.config.cost_model, "calibrated_at_step": self.calibrated_at,
                "link": self.link.as_dict() if self.link else None,
                "golomb_s_per_position": self.codec,
                "buckets": {b.name: dict(self.state[b.index].costs,
                                         mode=self.state[b.index].mode)
                            for b in self.buckets if b.sparse}}
