"""The sharded exchange: every rank serves one region of each bucket's index space.

With an allgather every rank receives all P ranks' selections, so its traffic grows with P. Here
(the reduce-scatter-then-allgather form of Ok-Topk and SparCML, and the server-free reading of
bidirectional Top-K: each rank is the server for one shard):

    uplink      each rank's selection, cut at the region bounds, one payload per owner
    all-to-all  owner r receives, from every rank in rank order, the entries of region r
    owner       sums them in rank order into its own downlink residual for the region,
                selects from it and keeps what it did not send
    allgather   the owners' selections, so every rank writes the same update; regions are in
                rank order, so the concatenated positions are already ascending

Per rank about ``k_up (P-1)/P`` pairs go out and come in on the all-to-all and ``k_down``
pairs arrive on the allgather, whatever P. What an owner selects: for Top-K under the global
rule, everything at or above one threshold for the whole bucket, found from every owner's
magnitude histograms (two small allreduces; :func:`coarse_bin`, :func:`fine_threshold`), and a
bucket too small for those histograms to pay goes by allgather instead
(:func:`allgather_is_cheaper`); otherwise the downlink density of the region's length (the
per-region rule, measured against exact global Top-K in ``benchmarks/sharded.py``). Regions
start as equal slices and follow the load counted from the gathered downlink positions
(:func:`load_counts`, :func:`balanced_bounds`) where the selection does not depend on a
region's length. A region's downlink residual lives on its owner alone: it is in that rank's
``state_dict`` and is restored on the same rank of a job of the same size, or from
:func:`hvd_sparse.merge_rank_states` of every rank's on a job of any size.

Methods that observe the aggregate (adaptive k) observe the gathered downlink selection, which
every rank holds, instead of the whole aggregate, which no rank holds.
"""
from __future__ import annotations

import warnings
from typing import List, Tuple

import numpy as np
import torch

from .. import kernels, wire
from ..feedback import Residual
from ..kernels import select, stream


def region_bounds(numel: int, size: int) -> Tuple[int, ...]:
    """``size + 1`` bounds of equal regions (the first ``numel % size`` one entry longer);
    regions are empty when the bucket has fewer entries than ranks."""
    base, extra = divmod(numel, size)
    out, at = [0], 0
    for r in range(size):
        at += base + (1 if r < extra else 0)
        out.append(at)
    return tuple(out)


LOAD_BINS = 1024  # position bins of a bucket's load statistic
REBALANCE_AT = 1.5  # busiest region's load over the mean that moves the bounds
COLD_SHARE = 0.25  # share of the balancing weight given by length rather than load


def load_counts(idx: torch.Tensor, numel: int, into=None) -> torch.Tensor:
    """How many of the positions ``idx`` fall in each of ``min(LOAD_BINS, numel)`` equal
    position bins, added to ``into`` when it has that many bins (float64 on ``idx``'s device,
    exact: summed over steps as the load statistic, and moved to the host only when the load
    is checked)."""
    bins = max(1, min(LOAD_BINS, numel))
    if into is None or into.numel() != bins:
        into = torch.zeros(bins, dtype=torch.float64, device=idx.device)
    if idx.numel():
        # index_add_ rather than bincount: no read of the largest index back to the host
        one = torch.ones((), dtype=torch.float64, device=idx.device).expand(idx.numel())
        into.index_add_(0, idx * bins // numel, one)
    return into


def region_loads(counts: torch.Tensor, bounds, numel: int) -> torch.Tensor:
    """The load of each region from the binned counts, a bin counted in the region that holds
    its first position (exact once bounds lie on bin edges, as re-balanced ones do)."""
    counts = counts.double().cpu()
    bins = counts.numel()
    starts = -(-torch.arange(bins, dtype=torch.int64) * numel // bins)  # first position of a bin
    owner = torch.searchsorted(torch.tensor(bounds[1:-1], dtype=torch.int64), starts,
                               right=True)
    return torch.zeros(len(bounds) - 1, dtype=torch.float64).index_add_(0, owner, counts)


def balanced_bounds(counts: torch.Tensor, numel: int, size: int) -> Tuple[int, ...]:
    """Region bounds on bin edges that share the expected load equally. The weight of a bin
    is its share of the load counts, mixed with its share of the length (``COLD_SHARE`` of
    the weight), so no region grows past 1 / COLD_SHARE times the equal length (its owner
    also scans it). Pure arithmetic on replicated counts: every rank gets the same bounds."""
    counts = counts.double().cpu()
    bins = counts.numel()
    total = float(counts.sum())
    load = counts.double() / total if total > 0 else torch.full((bins,), 1.0 / bins,
                                                                dtype=torch.float64)
    w = (1.0 - COLD_SHARE) * load + COLD_SHARE / bins
    cum = torch.cumsum(w, 0)
    targets = cum[-1] * torch.arange(1, size, dtype=torch.float64) / size
    edges = torch.searchsorted(cum, targets).clamp(max=bins - 1) + 1  # bins before the cut
    inner = (-(-edges * numel // bins)).tolist()  # the first position of bin ``edges``
    return tuple([0] + [int(x) for x in inner] + [numel])


def whole_from_regions(numel: int, pieces, dtype) -> Tuple[torch.Tensor, int]:
    """A bucket's whole downlink residual from the regions that owners of an earlier world
    still hold, ``(lo, hi, residual)`` each, in any order (the same region twice counts
    once); positions no piece covers (a departed owner's) are zeros. The pieces come from one
    world (the last agreed one), so they do not overlap. Returns the residual and how many
    positions the pieces covered."""
    whole = torch.zeros(numel, dtype=dtype)
    covered, seen = 0, set()
    for lo, hi, res in pieces:
        if (lo, hi) in seen or not 0 <= lo <= hi <= numel or res.numel() != hi - lo:
            continue
        seen.add((lo, hi))
        whole[lo:hi] = res.reshape(-1).to(dtype)
        covered += hi - lo
    return whole, covered


def cut_points(idx: torch.Tensor, bounds) -> List[int]:
    """Where each region's entries start and end in the ascending positions ``idx`` (one host
    read for all regions)."""
    inner = torch.tensor(bounds[1:-1], dtype=idx.dtype, device=idx.device)
    cuts = torch.searchsorted(idx, inner).tolist() if inner.numel() else []
    return [0] + cuts + [idx.numel()]


def encode_parts(idx, wire_values, bounds, *, constant, **encode_args):
    """One payload per region owner, concatenated, and their byte counts."""
    cuts = cut_points(idx, bounds)
    parts = []
    for r in range(len(bounds) - 1):
        a, e = cuts[r], cuts[r + 1]
        values = wire_values if constant else wire_values[a:e]
        parts.append(wire.encode(idx[a:e], values, constant=constant, **encode_args))
    return torch.cat(parts), [p.numel() for p in parts]


def check_region(payloads, lo: int, hi: int, bucket: str) -> None:
    """Every received position lies in this owner's region (one host read)."""
    firsts = [p.indices[:1] for p in payloads if p.indices.numel()]
    lasts = [p.indices[-1:] for p in payloads if p.indices.numel()]
    if not firsts:
        return
    smallest, largest = torch.stack([torch.cat(firsts).min(), torch.cat(lasts).max()]).tolist()
    if smallest < lo or largest >= hi:
        raise wire.PayloadError(
            f"a rank sent positions {smallest}..{largest} of bucket '{bucket}' to the owner of "
            f"{lo}..{hi - 1}: the ranks disagree on the world size or the collective")


HIST_SHIFT = 20  # first round: 2048 bins of |x|, the exponent and 3 mantissa bits
BINS = 1 << (31 - HIST_SHIFT)
FINE_SHIFT = 9  # second round, inside the bin that holds the k-th: the next 11 bits
FINE_BINS = 1 << (HIST_SHIFT - FINE_SHIFT)
TINY = float(np.nextafter(np.float32(0), np.float32(1)))


HISTOGRAM_TENSOR_BYTES = (BINS + FINE_BINS) * 8  # one bucket's two histograms, float64 counts


def histogram_bytes(size: int) -> int:
    """Bytes one rank receives for one bucket's two histograms (a ring allreduce moves
    2 (P-1)/P of the tensor to each rank)."""
    return int(2 * (size - 1) / size * HISTOGRAM_TENSOR_BYTES)


def allgather_is_cheaper(k_up: int, k_down: int, size: int, pair_bytes: int) -> bool:
    """Whether an allgather of the uplink selections receives no more bytes per rank than the
    sharded exchange with the global rule's histograms: P - 1 selections against an
    all-to-all and an allgather of about (P-1)/P of one selection each, plus the histograms.
    Small buckets at a few ranks (every bucket at two): their exact global Top-K is cheapest
    when every rank picks it from all the selections itself."""
    gathered = (size - 1) * k_up * pair_bytes
    sharded = (size - 1) / size * (k_up + k_down) * pair_bytes + histogram_bytes(size)
    return gathered <= sharded


def _bits_to_float(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def coarse_bin(hist, k: int):
    """First round, from the whole bucket's coarse histogram: the bin holding the k-th
    largest magnitude and how many entries lie above that bin; ``None`` when k reaches into
    the zeros (then every non-zero entry is selected)."""
    counts = hist.double().cpu().numpy().copy()
    counts[0xFF << (23 - HIST_SHIFT):] = 0  # exponent 255: Inf/NaN (reported by flags)
    counts[0] = 0  # zeros and the smallest denormals
    at_or_above = np.cumsum(counts[::-1])[::-1]  # at_or_above[b]: entries in bins >= b
    if k <= 0 or at_or_above[0] < k:
        return None
    b = int(np.searchsorted(-at_or_above, -k, side="right")) - 1  # last bin with >= k above
    above = int(at_or_above[b + 1]) if b + 1 < counts.size else 0
    return b, above


def fine_threshold(b: int, above: int, fine, k: int) -> float:
    """Second round: inside coarse bin ``b`` (``above`` entries lie higher), the finer edge
    whose count of entries at or above it is closest to ``k`` (ties: the lower, more)."""
    counts = fine.double().cpu().numpy()
    at_or_above = above + np.cumsum(counts[::-1])[::-1]
    j = int(np.searchsorted(-at_or_above, -k, side="right")) - 1
    j = max(j, 0)
    if j + 1 < counts.size and at_or_above[j] - k > k - at_or_above[j + 1]:
        j += 1
    if b == 0 and j == 0:
        return float(select.tiny())  # TINY, unless subnormals flush to zero
    return _bits_to_float((b << HIST_SHIFT) | (j << FINE_SHIFT))


class ShardedExchange:
    """The :class:`~hvd_sparse.engine.pipeline.Engine` methods of the sharded collective:
    region residuals, owners serving their regions, re-balanced bounds."""

    def _bounds(self, b):
        """The bucket's region bounds: re-balanced ones when made for this world size, else
        equal regions."""
        size = self.transport.size()
        bounds = self.state[b.index].bounds
        if bounds is None or len(bounds) != size + 1:
            return region_bounds(b.numel, size)
        return bounds

    def _region(self, b):
        bounds = self._bounds(b)
        rank = self.transport.rank()
        return bounds[rank], bounds[rank + 1]

    def _shard(self, b, lo, hi, device):
        """This rank's region residual: zeros when new, and when the world changed since it
        was made (its region is another one now; the mass it held is dropped, with a warning)."""
        st = self.state[b.index]
        layout = (self.transport.size(), self.transport.rank(), lo, hi)
        if st.shard is not None and st.shard_layout != layout:
            if st.shard.buffer is not None and bool(st.shard.buffer.any()):
                warnings.warn(f"bucket '{b.name}': the world changed since this rank's region "
                              "residual was made; its unsent aggregate is dropped")
            st.shard = None
        if st.shard is None:
            st.shard = Residual(hi - lo, st.downlink.dtype)
            st.shard_layout = layout
            whole = st.downlink.buffer
            if whole is not None:
                # a whole downlink residual (a merged or allgather-collective checkpoint, on
                # every rank alike): this rank keeps its region of it
                st.shard.load(whole[lo:hi].to(device).clone())
                st.downlink.buffer = None
        return st.shard.ensure(torch.empty(0, device=device))

    def _set_collective(self, b, new: str) -> None:
        """Switch a bucket between the collectives ("auto", at calibration, on every rank):
        the replicated downlink residual is cut into regions, or the owners' regions are
        allgathered back into it; no mass is lost either way."""
        st = self.state[b.index]
        if st.collective == new:
            return
        device = b.params[0].device
        lo, hi = self._region(b)
        if new == "sharded":
            st.shard = None
            self._shard(b, lo, hi, device)  # cuts this rank's region from the whole residual
        else:
            self._regions_to_replicated(b)
        st.collective = new

    def _regions_to_replicated(self, b) -> None:
        """Every owner's region residual allgathered (regions in rank order) into the bucket's
        replicated downlink residual; called on every rank alike (at calibration)."""
        st = self.state[b.index]
        st.downlink.load(self._gather_regions(b))
        st.shard, st.shard_layout = None, None

    def _gather_regions(self, b) -> torch.Tensor:
        """The whole downlink residual from the owners' regions (an allgather; every rank)."""
        st = self.state[b.index]
        lo, hi = self._region(b)
        mine = self._shard(b, lo, hi, b.params[0].device)  # cut from a whole one, if any
        handle = self.transport.allgather_async(
            mine.contiguous().view(torch.uint8), f"hvd_sparse.{b.index}.{b.name}.regions")
        return self.transport.wait(handle).view(st.downlink.dtype)

    def _rebalances(self, b) -> bool:
        """Whether this sharded bucket's bounds may move: only where what is selected does not
        depend on a region's length (Top-K under the global rule, the hard threshold, no
        downlink selection at all)."""
        c = self.config
        return (c.rebalance_every > 0 and self.transport.size() > 1
                and self.collective(b) == "sharded" and self.state[b.index].mode != "dense"
                and (not c.bidirectional or self._global_rule(b)
                     or c.downlink_sparsifier.name == "threshold"))

    def _record_load(self, b, idx) -> None:
        """Count the gathered downlink positions (the same on every rank) per position bin."""
        st = self.state[b.index]
        st.load = load_counts(idx, b.numel, into=st.load)

    def _rebalance(self, b) -> None:
        """Every rank at the same step: when the busiest region's load exceeds
        ``REBALANCE_AT`` times the mean, move the bounds to balance it and the region
        residuals with them (allgathered whole, then cut again: no mass moves or is lost)."""
        st = self.state[b.index]
        load, st.load = st.load, None
        if load is None or float(load.sum()) <= 0:
            return
        size = self.transport.size()
        loads = region_loads(load, self._bounds(b), b.numel)
        if float(loads.max()) <= REBALANCE_AT * float(loads.mean()):
            return
        new = balanced_bounds(load, b.numel, size)
        if new == tuple(self._bounds(b)):
            return
        full = self._gather_regions(b) if self.config.bidirectional else None
        st.bounds = new
        st.shard, st.shard_layout = None, None
        if full is not None:
            lo, hi = self._region(b)
            self._shard(b, lo, hi, full.device).copy_(full[lo:hi])

    def _serve_region(self, b, received):
        """Owner, first half: the entries every rank sent for this rank's region, summed in rank
        order into its region residual (or a zeroed scratch without a downlink)."""
        c = self.config
        job = self.inflight[b.index]
        payloads, a2a_bytes = received
        lo, hi = self._region(b)
        scale = (c.predivide / self.transport.size()) if c.average else 1.0
        device = b.params[0].device
        with self.clock.stage("aggregate", b.index):
            for p in payloads:
                p.values = c.compression.decompress(p.values, job.ctx)
            check_region(payloads, lo, hi, b.name)
            st = self.state[b.index]
            if c.bidirectional:
                region = self._shard(b, lo, hi, device)
            else:  # a scratch of its own (the flat-gradient buffer may still be in use)
                region = st.region_scratch
                if region is None or region.numel() != hi - lo or region.device != device:
                    st.region_scratch = region = torch.zeros(hi - lo, dtype=st.downlink.dtype,
                                                             device=device)
                else:
                    stream.zero_(region)
                if st.downlink.buffer is not None:  # every owner takes its region, then none
                    region.add_(self._pending(b, lo, hi, device))
                    st.downlink.buffer = None
            ops = kernels.ops_for(region)
            for p in payloads:  # rank order; indices unique within a payload
                if p.indices.numel():
                    ops.scatter_add(region, p.indices - lo, p.values, scale)
        self._serving[b.index] = (region, payloads, a2a_bytes)

    def _global_rule(self, b) -> bool:
        """The downlink of this sharded bucket keeps the bucket's top entries under one global
        threshold (Top-K with ``sharded_selection="global"``), not each region's own top.
        Buckets too small for the histograms to pay are not sharded at all
        (:meth:`_exact_by_allgather`)."""
        c = self.config
        return (c.bidirectional and c.sharded_selection == "global"
                and c.downlink_sparsifier.name == "topk")

    def _global_thresholds(self, served) -> dict:
        """Two small allreduces for every bucket under the global rule at once: each owner's
        coarse magnitude histogram of its region, summed, names the bin that holds the
        bucket's k-th magnitude; a finer histogram inside that bin, summed, gives the threshold
        whose count is closest to k (within one fine bin, 2**-14 of the magnitude)."""
        chosen = [b for b in served if self._global_rule(b)]
        if not chosen:
            return {}
        _, down_density = self.densities()
        ks = {b.index: max(1, int(down_density * b.numel)) for b in chosen}
        regions = {b.index: self._serving[b.index][0] for b in chosen}

        def summed(parts, name):
            with self.clock.stage("collective_wait"):
                handle = self.transport.allreduce_async(torch.cat(parts), name, average=False)
                return self.transport.wait(handle).double().cpu()

        with self.clock.stage("downlink_select"):
            coarse = [kernels.ops_for(regions[b.index]).magnitude_histogram(
                regions[b.index], HIST_SHIFT, BINS) for b in chosen]
        total = summed(coarse, "hvd_sparse.histograms")
        bins = {b.index: coarse_bin(total[i * BINS:(i + 1) * BINS],
                                            ks[b.index]) for i, b in enumerate(chosen)}
        with self.clock.stage("downlink_select"):
            fine = [kernels.ops_for(regions[b.index]).magnitude_histogram(
                regions[b.index], FINE_SHIFT, FINE_BINS, HIST_SHIFT,
                bins[b.index][0] if bins[b.index] else -1) for b in chosen]
        total = summed(fine, "hvd_sparse.histograms.fine")
        size = self.transport.size()
        out = {}
        for i, b in enumerate(chosen):
            # a ring allreduce moves 2 (P-1)/P of the tensor each way per rank, twice here
            self._histogram_bytes[b.index] = histogram_bytes(size)
            if bins[b.index] is None:
                out[b.index] = TINY  # k reaches into the zeros: every non-zero entry
                continue
            cb, above = bins[b.index]
            part = total[i * FINE_BINS:(i + 1) * FINE_BINS]
            out[b.index] = fine_threshold(cb, above, part, ks[b.index])
        return out

    def _select_region(self, b, threshold=None):
        """Owner, second half: select from the region (by the global threshold when given,
        else by the downlink sparsifier on the region alone), keep the rest in the region
        residual, and send the selection to every rank with an allgather."""
        c = self.config
        region, payloads, a2a_bytes = self._serving[b.index]
        lo, hi = self._region(b)
        ops = kernels.ops_for(region)
        if c.bidirectional:
            _, down_density = self.densities()
            ctx = self._ctx(b, "down", whole=False)
            with self.clock.stage("downlink_select", b.index):
                if threshold is not None:
                    sel = select.threshold(ops, None, region, threshold)
                else:
                    sel = c.downlink_sparsifier.fused(ops, None, region, down_density, ctx)
                if sel is not None and not sel.nonfinite:
                    idx, values = sel.idx, sel.values
                    wire_values, sent, codec = self._to_wire(b, values, prescale=False)
                    select.commit(ops, None, region, sel, sent)
                else:
                    idx, values = c.downlink_sparsifier.compress(region, down_density, ctx)
                    wire_values, sent, codec = self._to_wire(b, values, prescale=False)
                    self.state[b.index].shard.settle(idx, sent)
            constant = c.downlink_sparsifier.constant_value
        else:  # the region's whole aggregate, on the union of what was received
            with self.clock.stage("aggregate", b.index):
                got = [p.indices for p in payloads if p.indices.numel()]
                idx = torch.unique(torch.cat(got)) - lo if got else \
                    torch.empty(0, dtype=torch.int64, device=region.device)
                wire_values, _, codec = self._to_wire(b, region[idx], prescale=False)
            constant = False
        with self.clock.stage("encode", b.index):
            payload = wire.encode(idx + lo, wire_values, index_dtype=b.index_dtype, tag=b.tag,
                                  numel=b.numel, index_coding=self.index_coding(b),
                                  constant=constant)
        handle = self.transport.allgather_async(payload, f"hvd_sparse.{b.index}.{b.name}.down")
        self._serving[b.index] = (handle, payload.numel(), codec, a2a_bytes)

    def _apply_regions(self, b, write):
        """Every rank: the owners' selections (regions in rank order, so positions ascend) are
        the update, written as zero-fill plus scatter."""
        c = self.config
        job = self.inflight[b.index]
        handle, own_bytes, codec, a2a_bytes = self._serving[b.index]
        with self.clock.stage("collective_wait"):
            gathered = self.transport.wait(handle)
        with self.clock.stage("decode", b.index):
            payloads = wire.decode_all(gathered, self.transport.size(), tag=b.tag,
                                       numel=b.numel, bucket=b.name)
            idx = torch.cat([p.indices for p in payloads])
            values = torch.cat([c.compression.decompress(p.values, codec) for p in payloads])
        if c.sparsifier.observes or c.downlink_sparsifier.observes:
            c.sparsifier.observe(values, self._ctx(b, "up"))
            c.downlink_sparsifier.observe(values, self._ctx(b, "down"))
        if self._rebalances(b):
            self._record_load(b, idx)
        grad = b.params[0].grad
        ops = kernels.ops_for(grad if grad is not None and not grad.is_sparse else values)
        with self.clock.stage("write", b.index):
            self._write_sparse(b, idx, values, job.sparse_grads, write, ops, job.zeroed)
        hist = self._histogram_bytes.pop(b.index, 0)
        self.stats.record(b.name, sent=job.nbytes + own_bytes + hist,
                          received=a2a_bytes - job.own_bytes + gathered.numel() - own_bytes
                          + hist,
                          dense=b.nbytes, selected=job.selected, numel=b.numel,
                          target=job.target, error=job.error, downlink_selected=idx.numel())
        # what an allgather of this rank's payload would bring (the cost model's common unit)
        if self._at_target_density():
            self._note_wire(b, self.transport.size() * (job.nbytes + job.own_bytes), 0)
