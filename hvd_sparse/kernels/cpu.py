"""CPU selection primitives with numba: read-only scans near memory speed, multi-threaded.

The methods in :mod:`hvd_sparse.kernels.select` are written once against four primitives; this
module is their numba form for float32 CPU tensors (``g`` is the gradient, or ``None`` on the
downlink where the residual already holds the aggregate; ``acc = g + r``):

* :func:`scan` - one read of ``g`` and ``r``, writing nothing to them: counts the candidates
  (``acc >= t_hi`` or ``acc <= -t_lo``), collects them in index order (per-chunk in parallel),
  flags NaN/Inf and sums ``acc^2``; asked to, it also writes ``acc`` into a buffer of the
  caller's (:class:`AccumulatingOps`, the uplink's);
* :func:`gather` - hands the scan's candidates over (a second pass only when more came than
  the room the caller expected);
* :func:`kth_magnitude` - the exact k-th largest ``|acc|`` (radix histogram on the float bits),
  for the rare case where a sampled threshold aimed too high;
* :func:`commit` - ``r += g`` and the selected positions set to what the wire could not carry.

For the downlink watch (:mod:`.watch`): :func:`scatter_add` with ``read=True`` hands back the
values it wrote, :func:`candidates` merges position lists through a bit set, and
:func:`pick_unordered` and :func:`outside` select among candidates in any order.

Nothing writes the residual before :func:`commit` (or the engine's buffer swap), so a step that
some rank has to skip (a NaN anywhere) leaves every residual exactly as it was. Fast math is on
except for the NaN/Inf assumptions, which would remove the non-finite check. numba is optional:
without it :func:`available` is False and the torch reference serves.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import torch

from . import reference

try:
    import numba
    from numba import njit, prange

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - depends on the installation
    HAVE_NUMBA = False

BLOCK = 32  # entries per candidate bit mask (one uint32)
#: below this many candidates _kth_positions ranks them with range-limited histograms
SHORT_LIST = 16384
BINS = 1 << 16
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}  # not nnan/ninf: NaN must be seen
FLT_MAX = np.float32(3.4028234663852886e38)

name = "numba"


def available() -> bool:
    return HAVE_NUMBA


if HAVE_NUMBA:
    from numba.cpython.unsafe.numbers import trailing_zeros

    @njit(cache=True, inline="always")
    def _minus(x, y):
        """``x - y`` rounded as such: compiled without fast math, so the scan that calls it
        cannot fold the difference into the sum that follows (its bits are a weight change's,
        as ``torch.sub`` makes it)."""
        return x - y

    @njit(fastmath=FASTMATH, cache=True)
    def _scan_chunk(g, r, thi, tlo, base, out_idx, out_val, start, cap, into, h=None,
                    reset=False):
        """One read of a chunk: candidates (``acc >= thi`` or ``acc <= -tlo``) appended to
        ``out[start:start + cap]`` in index order, while they fit (slot ``start + cap`` is
        written too, and must exist and be free); returns (candidates seen,
        sum of acc^2). ``acc`` is ``r`` when ``g`` and ``into`` are None, ``g + r`` when
        ``into`` is None, and else ``g + r`` written into ``into`` in the same pass, or
        ``into + r`` written back into ``into`` when ``g`` is None (in place: one array
        argument, so the loop vectorises without an aliasing check). ``h`` (with ``g`` and
        ``into``): ``acc = (g - h) + r``, a weight change ``params - anchor`` never
        written by itself (:class:`AccumulatingOps` with ``minus``); ``reset`` then also
        writes ``g = h`` (the parameters back at the anchor) in the same pass

        Per 32-entry block a vectorised loop builds a bit mask of the candidates and sums
        ``a * a``; the set bits are then visited one by one (trailing-zero count), so only
        candidates cost a scalar step. The sum of squares doubles as the NaN/Inf check: it is
        finite exactly when every ``a`` is (and no block's float32 sum of squares overflows,
        i.e. no magnitude near 1e18 or above: the engine confirms a flag with an exact pass),
        and fast math here keeps NaN/Inf semantics."""
        n = r.size
        full = n // BLOCK
        pos = 0
        energy = 0.0
        # |a| >= t is a >= t or a <= -t, except at t = 0 where -0.0 and NaN differ: both
        # forms agree on those (NaN: neither; -0.0 >= 0 and |-0.0| >= 0: both). Symmetric
        # thresholds take one compare per entry instead of two
        symmetric = thi == tlo
        for b in range(full):
            lo = b * BLOCK
            mask = np.uint32(0)
            e = np.float32(0)
            if g is None:
                if into is None:
                    if symmetric:
                        for j in range(BLOCK):
                            a = r[lo + j]
                            mask |= np.uint32(abs(a) >= thi) << np.uint32(j)
                            e += a * a
                    else:
                        for j in range(BLOCK):
                            a = r[lo + j]
                            mask |= np.uint32((a >= thi) | (a <= -tlo)) << np.uint32(j)
                            e += a * a
                else:
                    if symmetric:
                        for j in range(BLOCK):
                            a = into[lo + j] + r[lo + j]
                            into[lo + j] = a
                            mask |= np.uint32(abs(a) >= thi) << np.uint32(j)
                            e += a * a
                    else:
                        for j in range(BLOCK):
                            a = into[lo + j] + r[lo + j]
                            into[lo + j] = a
                            mask |= np.uint32((a >= thi) | (a <= -tlo)) << np.uint32(j)
                            e += a * a
            else:
                if into is None:
                    if symmetric:
                        for j in range(BLOCK):
                            a = g[lo + j] + r[lo + j]
                            mask |= np.uint32(abs(a) >= thi) << np.uint32(j)
                            e += a * a
                    else:
                        for j in range(BLOCK):
                            a = g[lo + j] + r[lo + j]
                            mask |= np.uint32((a >= thi) | (a <= -tlo)) << np.uint32(j)
                            e += a * a
                elif h is None:
                    if symmetric:
                        for j in range(BLOCK):
                            a = g[lo + j] + r[lo + j]
                            into[lo + j] = a
                            mask |= np.uint32(abs(a) >= thi) << np.uint32(j)
                            e += a * a
                    else:
                        for j in range(BLOCK):
                            a = g[lo + j] + r[lo + j]
                            into[lo + j] = a
                            mask |= np.uint32((a >= thi) | (a <= -tlo)) << np.uint32(j)
                            e += a * a
                else:
                    if symmetric:
                        for j in range(BLOCK):
                            a = _minus(g[lo + j], h[lo + j]) + r[lo + j]
                            into[lo + j] = a
                            mask |= np.uint32(abs(a) >= thi) << np.uint32(j)
                            e += a * a
                    else:
                        for j in range(BLOCK):
                            a = _minus(g[lo + j], h[lo + j]) + r[lo + j]
                            into[lo + j] = a
                            mask |= np.uint32((a >= thi) | (a <= -tlo)) << np.uint32(j)
                            e += a * a
                    if reset:  # the block is in cache: a loop of its own keeps both simple
                        for j in range(BLOCK):
                            g[lo + j] = h[lo + j]
            energy += e
            # the block's first two candidates without a branch: at the densities used a
            # block holds none, one or two about equally unpredictably, and a mispredicted
            # loop exit cost more than the rest of a candidate's work. Each is written at
            # slot min(pos, cap): the spare slot after the room (the caller leaves one) once
            # the room is full; a block without one writes the next free slot, which nothing
            # counts. The rare rest in the loop below
            for _ in range(2):
                has = np.int64(mask != 0)
                j = trailing_zeros(np.uint64(mask) | np.uint64(1 << 32)) & 31
                w = start + min(pos, cap)
                out_idx[w] = base + lo + j
                if into is not None:  # acc as written
                    out_val[w] = into[lo + j]
                else:
                    if g is None:
                        out_val[w] = r[lo + j]
                    else:
                        out_val[w] = g[lo + j] + r[lo + j]
                pos += has
                mask &= mask - np.uint32(has)
            while mask != 0:
                j = trailing_zeros(mask)
                if pos < cap:
                    out_idx[start + pos] = base + lo + j
                    if into is not None:  # acc as written
                        out_val[start + pos] = into[lo + j]
                    else:
                        if g is None:
                            out_val[start + pos] = r[lo + j]
                        else:
                            out_val[start + pos] = g[lo + j] + r[lo + j]
                pos += 1
                mask &= mask - np.uint32(1)
        for i in range(full * BLOCK, n):
            if g is None:
                if into is None:
                    a = r[i]
                else:
                    a = into[i] + r[i]
                    into[i] = a
            else:
                if h is None:
                    a = g[i] + r[i]
                else:
                    a = _minus(g[i], h[i]) + r[i]
                    if reset:
                        g[i] = h[i]
                if into is not None:
                    into[i] = a
            energy += a * a
            if (a >= thi) | (a <= -tlo):
                if pos < cap:
                    out_idx[start + pos] = base + i
                    out_val[start + pos] = a
                pos += 1
        return pos, energy

    @njit(parallel=True, cache=True)
    def _scan_par(g, r, thi, tlo, chunk, out_idx, out_val, starts, caps, counts, energies,
                  into):
        for c in prange(counts.size):
            lo = c * chunk
            hi = min(r.size, lo + chunk)
            if g is None:
                if into is None:
                    t, e = _scan_chunk(None, r[lo:hi], thi, tlo, lo, out_idx, out_val,
                                       starts[c], caps[c], None)
                else:
                    t, e = _scan_chunk(None, r[lo:hi], thi, tlo, lo, out_idx, out_val,
                                       starts[c], caps[c], into[lo:hi])
            else:
                if into is None:
                    t, e = _scan_chunk(g[lo:hi], r[lo:hi], thi, tlo, lo, out_idx, out_val,
                                       starts[c], caps[c], None)
                else:
                    t, e = _scan_chunk(g[lo:hi], r[lo:hi], thi, tlo, lo, out_idx, out_val,
                                       starts[c], caps[c], into[lo:hi])
            counts[c] = t
            energies[c] = e

    @njit(cache=True)
    def _radix_kth(bits, k):
        """The k-th largest of non-negative float bit patterns (they order like the values):
        a histogram of the top 16 bits names its bin, one of the low 16 bits inside that bin
        names it. Returns (its bits, how many entries equal to it the k largest take, how many
        equal it). Each histogram spans only the range its entries occupy (found by a pass of
        their own): a full 65,536-bin one costs zeroing 512 kB and walking the bins, tens of
        microseconds that dominated short selections (small buckets, few candidates)."""
        if bits.size == 0:  # (nothing to rank: as the full histogram answered)
            return np.uint32(0xFFFFFFFF), np.int64(k), np.int64(0)
        top_hi, top_lo = np.uint32(0), np.uint32(65535)
        for i in range(bits.size):
            t = bits[i] >> 16
            top_hi = max(top_hi, t)
            top_lo = min(top_lo, t)
        hist = np.zeros(np.int64(top_hi) - np.int64(top_lo) + 1, dtype=np.int64)
        for i in range(bits.size):
            hist[(bits[i] >> 16) - top_lo] += 1
        above = 0
        top = hist.size - 1
        while above + hist[top] < k:
            above += hist[top]
            top -= 1
        need = k - above  # how many to take from bin ``top``
        topv = np.uint32(top) + top_lo
        low_hi, low_lo = np.uint32(0), np.uint32(65535)
        for i in range(bits.size):
            if (bits[i] >> 16) == topv:
                low = bits[i] & np.uint32(0xFFFF)
                low_hi = max(low_hi, low)
                low_lo = min(low_lo, low)
        hist = np.zeros(np.int64(low_hi) - np.int64(low_lo) + 1, dtype=np.int64)
        for i in range(bits.size):
            if (bits[i] >> 16) == topv:
                hist[(bits[i] & np.uint32(0xFFFF)) - low_lo] += 1
        low = hist.size - 1
        while hist[low] < need:
            need -= hist[low]
            low -= 1
        return (topv << np.uint32(16)) | (np.uint32(low) + low_lo), need, hist[low]

    @njit(cache=True)
    def _pick(cidx, cval, k, sign):
        """The k candidates of largest ``|v|`` (sign 0) or ``sign * v`` (the other side
        scoring zero, never taken while k candidates score above it), ties by lowest index
        (candidates come in index order, and so do the results).

        Radix select on the bits of ``|v|`` (for non-negative floats the bit pattern orders
        like the value): a histogram of the top 16 bits names the bin of the k-th magnitude,
        a second one of the low 16 bits inside that bin names the k-th magnitude itself
        (:func:`_kth_positions`, which reads the candidates twice; a signed pick scores them
        into an array first and ranks that with :func:`_radix_kth`), and one pass in index
        order takes everything above it plus the lowest-index ties. No partition (an exact
        partition of the k-th bin cost more than the rest together)."""
        m = cval.size
        mask = np.uint32(0x7FFFFFFF)
        if sign == 0:  # |v| read where it lies (two reads to rank it)
            bits = cval.view(np.uint32)
            kth, ties, _ = _kth_positions(cval, k)
        else:
            bits = cval.view(np.uint32) & mask
            if sign > 0:  # branch-free: the sides of candidates alternate at random
                for i in range(m):
                    bits[i] *= np.uint32(cval[i] > 0)
            else:
                for i in range(m):
                    bits[i] *= np.uint32(cval[i] < 0)
            kth, ties, _ = _radix_kth(bits, k)
        # ties: taken at the k-th magnitude, lowest first
        out_idx = np.empty(k + 1, dtype=np.int64)  # one spare slot: written, not kept
        out_val = np.empty(k + 1, dtype=np.float32)
        pos = 0
        for i in range(m):  # branch-free: taken or not is close to a coin toss
            b = bits[i] & mask
            tie = (b == kth) & (ties > 0)
            ties -= np.int64(tie)
            out_idx[pos] = cidx[i]
            out_val[pos] = cval[i]
            pos += np.int64((b > kth) | tie)
        return out_idx[:k], out_val[:k]

    @njit(cache=True)
    def _split_sides(cidx, cval):
        """The candidates above zero and those below, each in index order (none is zero:
        both sides' thresholds are positive)."""
        m = cval.size
        pos_idx = np.empty(m + 1, dtype=np.int64)
        pos_val = np.empty(m + 1, dtype=np.float32)
        neg_idx = np.empty(m + 1, dtype=np.int64)
        neg_val = np.empty(m + 1, dtype=np.float32)
        p = q = 0
        for i in range(m):  # branch-free: the sides alternate at random
            x, v = cidx[i], cval[i]
            pos_idx[p] = x
            pos_val[p] = v
            neg_idx[q] = x
            neg_val[q] = v
            up = np.int64(v > 0)
            p += up
            q += 1 - up
        return pos_idx[:p], pos_val[:p], neg_idx[:q], neg_val[:q]

    @njit(cache=True)
    def _scatter_add(target, idx, vals, scale):
        for j in range(idx.size):
            target[idx[j]] += vals[j] * scale

    @njit(cache=True)
    def _support_values(scratch, idx, out, pos):
        """Read and clear ``scratch`` at ``idx``: each position's sum is taken once (the
        first time it is met) and ``scratch`` is left all zeros again."""
        for j in range(idx.size):
            i = idx[j]
            v = scratch[i]
            if v != 0.0:
                out[pos] = v
                pos += 1
                scratch[i] = 0.0
        return pos

    @njit(cache=True)
    def _merge_two(ai, av, sa, bi, bv, sb, out_i, out_v):
        """Two ascending, unique position lists merged: ``av * sa`` plus ``bv * sb`` where a
        position is in both (float32, in that order); a side without the position adds
        zero, which changes no bit of a non-zero sum. Branch-free: which list holds the next
        position is a coin toss. Returns the merged length."""
        na, nb = ai.size, bi.size
        i = j = p = 0
        zero = np.float32(0.0)
        while i < na and j < nb:
            a, b = ai[i], bi[j]
            ta, tb = a <= b, b <= a
            xa = av[i] * sa if ta else zero
            xb = bv[j] * sb if tb else zero
            out_i[p] = a if ta else b
            out_v[p] = xa + xb
            i += np.int64(ta)
            j += np.int64(tb)
            p += 1
        while i < na:
            out_i[p] = ai[i]
            out_v[p] = av[i] * sa
            i += 1
            p += 1
        while j < nb:
            out_i[p] = bi[j]
            out_v[p] = bv[j] * sb
            j += 1
            p += 1
        return p

    @njit(cache=True)
    def _merged_sums(idx, vals, starts, scale, out):
        """The aggregate's non-zero values without touching a full-length array: the P
        payloads (``idx[starts[r]:starts[r + 1]]``, each ascending and unique) merged by
        position one rank after another, so each position's sum is ``((0 + v0 s) + v1 s) +
        ...`` in rank order, as the scatter into a zeroed scratch adds it (``0 + y`` is
        ``y``, and a rank without the position adds nothing: the same bits; a zero partial
        sum only ever meets ``+ y`` again). Written to ``out`` in ascending position, zeros
        (cancellations) left out; returns how many."""
        ranks = starts.size - 1
        one = np.float32(1.0)
        m = starts[1] - starts[0]
        if ranks == 1:
            src_v = vals[:m] * scale  # rank 0's terms, as the first scatter leaves them
        else:
            buf_i = np.empty((2, idx.size), dtype=np.int64)
            buf_v = np.empty((2, idx.size), dtype=np.float32)
            m = _merge_two(idx[:starts[1]], vals[:starts[1]], scale,
                           idx[starts[1]:starts[2]], vals[starts[1]:starts[2]], scale,
                           buf_i[0], buf_v[0])
            for r in range(2, ranks):
                cur, nxt = (r - 2) % 2, (r - 1) % 2
                m = _merge_two(buf_i[cur, :m], buf_v[cur, :m], one,
                               idx[starts[r]:starts[r + 1]], vals[starts[r]:starts[r + 1]],
                               scale, buf_i[nxt], buf_v[nxt])
            src_v = buf_v[(ranks - 2) % 2, :m]
        n = 0
        for q in range(m):  # branch-free: written always, kept when non-zero
            x = src_v[q]
            out[n] = x
            n += np.int64(x != 0.0)
        return n

    @njit(cache=True)
    def _scatter_add_read(target, idx, vals, scale, out):
        """``_scatter_add`` that also hands back each written entry's new value (already in a
        register: no extra memory access); returns whether one of them is NaN/Inf."""
        bad = False
        for j in range(idx.size):
            i = idx[j]
            x = target[i] + vals[j] * scale
            target[i] = x
            out[j] = x
            bad |= not math.isfinite(x)
        return bad

    @njit(cache=True)
    def _scatter_add_twin(target, twin, idx, vals, scale):
        """``_scatter_add`` that also stores each new value in ``twin`` at the same position
        (one loop, no list of the new values in between)."""
        for j in range(idx.size):
            i = idx[j]
            x = target[i] + vals[j] * scale
            target[i] = x
            twin[i] = x

    @njit(cache=True, inline="always")
    def _first_mark(mark, i):
        """Set bit ``i`` of the bit set ``mark``; whether it was clear before."""
        w = i >> 6
        bit = np.uint64(1) << np.uint64(i & 63)
        m = mark[w]
        mark[w] = m | bit
        return not (m & bit)

    @njit(cache=True)
    def _collect(idx, val, bound, bound_neg, mark, out_idx, out_val, p):
        """Append the entries of one (index, value) list whose index is not yet marked (lists
        come newest first, so the current value wins), marking it; only ``v >= bound`` and
        ``v <= -bound_neg`` are appended. ``mark`` is a bit set over the positions. Returns the
        new length."""
        for j in range(idx.size):
            i = idx[j]
            if not _first_mark(mark, i):
                continue
            v = val[j]
            out_idx[p] = i
            out_val[p] = v
            p += (v >= bound) | (v <= -bound_neg)  # written always, kept or overwritten
        return p

    @njit(cache=True)
    def _collect_sides(idx, val, bound, bound_neg, mark, pi, pv, p, ni, nv, q):
        """``_collect`` that appends each kept entry to the side of its sign (above zero to
        ``pi, pv``, the others to ``ni, nv``) in the same pass: no list of both to split
        after. Returns the new lengths."""
        for j in range(idx.size):
            i = idx[j]
            if not _first_mark(mark, i):
                continue
            v = val[j]
            pi[p] = i
            pv[p] = v
            ni[q] = i
            nv[q] = v
            keep = (v >= bound) | (v <= -bound_neg)
            up = v > 0
            p += keep & up  # written always, kept or overwritten
            q += keep & (not up)
        return p, q

    @njit(cache=True)
    def _kth_positions(cval, k):
        """The k-th largest ``|v|`` of ``cval`` (k <= size) as float bits, how many
        entries of it the k largest take, and the positions in ``cval`` of every entry of
        it, in order. Two reads: a histogram of the top 16 bits of ``|v|`` (32,768 bins: the
        sign bit is cleared) names the k-th's bin, and one more read copies that bin's
        entries (low 16 bits and position; branch-free) into a short list, where the rest
        is found. ``_radix_kth`` reads everything four times: a range of its own before
        each histogram."""
        raw = cval.view(np.uint32)
        mask = np.uint32(0x7FFFFFFF)
        shift = np.uint32(16)
        m = raw.size
        if m == 0:  # (nothing to rank: as _radix_kth answers)
            return np.uint32(0xFFFFFFFF), np.int64(k), np.empty(0, dtype=np.int64)
        if m < SHORT_LIST:  # histograms over the range the entries occupy: a fixed one's
            bits = raw & mask  # zeroing and walk cost more than the rest here
            kth, need, ties = _radix_kth(bits, k)
            at_kth = np.empty(ties, dtype=np.int64)
            q = 0
            for i in range(m):
                if bits[i] == kth:
                    at_kth[q] = i
                    q += 1
            return kth, need, at_kth
        hist = np.zeros(32768, dtype=np.int32)
        for i in range(m):
            hist[(raw[i] & mask) >> shift] += 1
        top = 32767
        while hist[top] == 0:  # the largest present (k = 0 names the largest magnitude)
            top -= 1
        above = 0
        while above + hist[top] < k:
            above += hist[top]
            top -= 1
        need = k - above  # taken from bin ``top``, the largest first
        count = hist[top]
        low = np.empty(count + 1, dtype=np.uint32)  # one spare slot: written, not kept
        pos = np.empty(count + 1, dtype=np.int64)
        t = np.uint32(top)
        q = 0
        for i in range(m):  # branch-free: written always, kept when in the bin
            b = raw[i] & mask
            low[q] = b & np.uint32(0xFFFF)
            pos[q] = i
            q += np.int64((b >> shift) == t)
        hi, lo = np.uint32(0), np.uint32(65535)
        for j in range(count):
            hi = max(hi, low[j])
            lo = min(lo, low[j])
        hist2 = np.zeros(np.int64(hi) - np.int64(lo) + 1, dtype=np.int64)
        for j in range(count):
            hist2[low[j] - lo] += 1
        b = hist2.size - 1
        while hist2[b] < need:
            need -= hist2[b]
            b -= 1
        kl = np.uint32(b) + lo
        at_kth = np.empty(hist2[b], dtype=np.int64)
        q = 0
        for j in range(count):
            if low[j] == kl:
                at_kth[q] = pos[j]
                q += 1
        return (t << shift) | kl, need, at_kth

    @njit(cache=True)
    def _pick_unordered(cidx, cval, k):
        """The k entries of largest ``|v|`` among candidates in any order, ties by lowest
        index: the k-th magnitude from :func:`_kth_positions`, and of the entries tied at it
        the ``need`` lowest indices (a selection, not a sort: an SBC aggregate ties
        thousands of entries at one value; usually every tie is taken). Returns (chosen
        indices, values, the other indices, values), each in candidate order."""
        m = cval.size
        kth, need, tied = _kth_positions(cval, k)
        if need == 0:  # (k = 0)
            cutoff = np.int64(-1)
        elif need == tied.size:
            cutoff = np.int64(np.iinfo(np.int64).max)  # every entry tied at the k-th goes
        else:
            tied_idx = np.empty(tied.size, dtype=np.int64)
            for j in range(tied.size):
                tied_idx[j] = cidx[tied[j]]
            cutoff = np.partition(tied_idx, need - 1)[need - 1]
        raw = cval.view(np.uint32)
        mask = np.uint32(0x7FFFFFFF)
        sel_idx = np.empty(k + 1, dtype=np.int64)  # one spare slot each: written, not kept
        sel_val = np.empty(k + 1, dtype=np.float32)
        rest_idx = np.empty(m - k + 1, dtype=np.int64)
        rest_val = np.empty(m - k + 1, dtype=np.float32)
        p = q = 0
        for i in range(m):  # branch-free: both written, one kept
            b = raw[i] & mask
            x = cidx[i]
            v = cval[i]
            take = np.int64((b > kth) | ((b == kth) & (x <= cutoff)))
            sel_idx[p] = x
            sel_val[p] = v
            rest_idx[q] = x
            rest_val[q] = v
            p += take
            q += 1 - take
        return sel_idx[:k], sel_val[:k], rest_idx[:m - k], rest_val[:m - k]

    @njit(cache=True)
    def _outside(cidx, cval, sidx, mark):
        """The candidates whose index is not in ``sidx`` (any order), through marks in the bit
        set ``mark``, which is left all zero."""
        for j in range(sidx.size):
            x = sidx[j]
            mark[x >> 6] |= np.uint64(1) << np.uint64(x & 63)
        out_idx = np.empty(cidx.size, dtype=np.int64)
        out_val = np.empty(cidx.size, dtype=np.float32)
        p = 0
        for i in range(cidx.size):
            x = cidx[i]
            if not (mark[x >> 6] & (np.uint64(1) << np.uint64(x & 63))):
                out_idx[p] = x
                out_val[p] = cval[i]
                p += 1
        for j in range(sidx.size):
            mark[sidx[j] >> 6] = 0
        return out_idx[:p], out_val[:p]

    @njit(cache=True)
    def _largest(idx, val, k, bound):
        """The entries with ``|v|`` at or above both ``bound`` and the k-th largest ``|v|``
        (ties at it all kept), in their order, and that cut: radix select, one compaction."""
        raw = val.view(np.uint32)
        mask = np.uint32(0x7FFFFFFF)
        kth, _, _ = _kth_positions(val, k)
        cut = max(np.float32(bound), np.array([kth]).view(np.float32)[0])
        cut_bits = np.array([cut]).view(np.uint32)[0]
        out_idx = np.empty(idx.size, dtype=np.int64)
        out_val = np.empty(idx.size, dtype=np.float32)
        p = 0
        for i in range(idx.size):
            if raw[i] & mask >= cut_bits:
                out_idx[p] = idx[i]
                out_val[p] = val[i]
                p += 1
        return out_idx[:p], out_val[:p], cut

    @njit(cache=True)
    def _group(idx, vals, edges):
        """Entries grouped by the range ``[edges[j], edges[j + 1])`` holding their index, in
        their order within a group, indices made relative to the range's start: a counting
        sort, each entry's range from a table of the ranges at evenly spaced positions.
        Returns (indices, values, where each group starts)."""
        m = idx.size
        groups = edges.size - 1
        which = np.empty(m, dtype=np.int64)
        starts = np.zeros(groups + 1, dtype=np.int64)
        # a table of the group holding each 2**shift-th position: an entry's group is its
        # slot's, or a few after it (a binary search per entry cost 9 ms per million)
        length = max(edges[groups], 1)
        shift = 0
        while (length >> shift) > max(64, min(64 * groups, 4 * m)):
            shift += 1
        table = np.empty((length >> shift) + 1, dtype=np.int64)
        w = 0
        for t in range(table.size):
            while w < groups - 1 and edges[w + 1] <= (t << shift):
                w += 1
            table[t] = w
        for j in range(m):
            x = idx[j]
            w = table[x >> shift]
            while w < groups - 1 and edges[w + 1] <= x:
                w += 1
            which[j] = w
            starts[w + 1] += 1
        for w in range(groups):
            starts[w + 1] += starts[w]
        fill = starts[:groups].copy()
        out_idx = np.empty(m, dtype=np.int64)
        out_val = np.empty(m, dtype=vals.dtype)
        for j in range(m):
            w = which[j]
            q = fill[w]
            out_idx[q] = idx[j] - edges[w]
            out_val[q] = vals[j]
            fill[w] = q + 1
        return out_idx, out_val, starts

    @njit(cache=True)
    def _sample_acc(g, off, r, mn, positions, out):
        """``out[j] = (g[i - off] - mn[i]) + r[i]`` for ``i = positions[j]`` (``g`` None: ``r``
        alone; ``mn`` None: nothing subtracted). One loop instead of numpy's fancy indexing
        (an index array, a temporary per operand, then the sum): the sample's blocks are a
        few cache lines each, so the loop runs at the speed of those lines."""
        for j in range(positions.size):
            i = positions[j]
            if g is None:
                out[j] = r[i]
            elif mn is None:
                out[j] = g[i - off] + r[i]
            else:
                out[j] = r[i] + (g[i - off] - mn[i])

    @njit(cache=True)
    def _segment_topk(a, lo, n, k, spos, rank, floor, out_idx, out_val, o):
        """The exact top ``k`` of ``|a[lo:lo + n]|`` (ties by lowest index), in index order,
        into ``out[o:o + k]``. Candidates come from a threshold that the segment's fixed
        sample ranks ``rank``-th (when it has one), else, or when it found fewer than k, the
        whole segment is ranked; ``_pick_short`` then decides exactly."""
        if k >= n:
            for j in range(n):
                out_idx[o + j] = lo + j
                out_val[o + j] = a[lo + j]
            return
        # room for what the sample aims at (about 1.6 k) and more: a segment of many entries
        # at the threshold runs out of it and is ranked whole instead (room for every entry
        # would be a large fresh allocation per segment and step)
        cap = min(n, 4 * k + 1024)
        cidx = np.empty(cap + 1, dtype=np.int64)  # + the spare slot _scan_chunk writes
        cval = np.empty(cap + 1, dtype=np.float32)
        c = 0
        if rank > 0:
            scores = np.empty(spos.size, dtype=np.float32)
            m = 0
            for j in range(spos.size):
                s = abs(a[lo + spos[j]])
                if s >= floor:
                    scores[m] = s
                    m += 1
            t = floor
            if rank <= m:
                t = max(_coarse_kth(scores[:m], rank), floor)
            c, _ = _scan_chunk(None, a[lo:lo + n], t, t, lo, cidx, cval, 0, cap, None)
            if c > cap:  # out of room
                c = 0
        if c >= k:
            _pick_short(cidx[:c], cval[:c], 0, k, out_idx, out_val, o)
            return
        # no sample, or it aimed too high or too low: rank the whole segment
        _pick_short(cidx[:0], a[lo:lo + n], lo, k, out_idx, out_val, o)

    @njit(cache=True)
    def _coarse_kth(scores, rank):
        """A value at or below the ``rank``-th largest of non-negative ``scores``: the floor
        of its bin in a histogram of the top 12 bits of the float (eighths of an octave).
        Any threshold gives the same exact selection after it; this one costs one pass over
        a sample, where an exact rank of it (a radix with up to 65,536 bins, or numba's
        partition) cost more than the rest of a short tensor's selection."""
        bits = scores.view(np.uint32)
        hist = np.zeros(2048, dtype=np.int64)
        for j in range(bits.size):
            hist[bits[j] >> np.uint32(20)] += 1
        b = 2047
        seen = hist[b]
        while seen < rank and b > 0:
            b -= 1
            seen += hist[b]
        one = np.empty(1, dtype=np.uint32)
        one[0] = np.uint32(b) << np.uint32(20)
        return one.view(np.float32)[0]

    @njit(cache=True)
    def _kth_and_ties(vals, k):
        """The bits of the k-th largest magnitude of ``vals`` (1 <= k <= size), and how many
        entries of those bits the k largest take: its bin in a histogram of the top 12 bits
        of ``|v|``, then a sort of that bin's entries alone (numba's partition, or a radix
        whose second histogram may span 65,536 bins, cost more than the rest of a short
        tensor's selection). Magnitudes are compared as the bit patterns of ``|v|`` (which
        order like the values, as ``_pick`` ranks them), so a thread that flushes subnormals
        to zero ranks them as every other thread does. Two reads; NaN ruled out before."""
        bits = vals.view(np.uint32)
        mask = np.uint32(0x7FFFFFFF)
        shift = np.uint32(20)
        hist = np.zeros(2048, dtype=np.int32)
        for j in range(bits.size):
            hist[(bits[j] & mask) >> shift] += 1
        b = 2047
        above = 0
        while above + hist[b] < k:
            above += hist[b]
            b -= 1
        inbin = np.empty(hist[b], dtype=np.uint32)
        q = 0
        for j in range(bits.size):
            m = bits[j] & mask
            if m >> shift == b:
                inbin[q] = m
                q += 1
        inbin.sort()
        need = k - above  # taken from this bin, the largest first
        kth = inbin[inbin.size - need]
        i = inbin.size - 1
        while inbin[i] > kth:
            need -= 1
            i -= 1
        return kth, need

    @njit(cache=True)
    def _pick_short(cidx, cval, base, k, out_idx, out_val, o):
        """``_pick(cidx, cval, k, 0)`` written to ``out[o:o + k]``, for the lists of one
        tensor; with ``cidx`` empty the positions are ``base + j`` (a whole tensor, ranked
        where it lies: no list made of it)."""
        kth, ties = _kth_and_ties(cval, k)
        bits = cval.view(np.uint32)
        mask = np.uint32(0x7FFFFFFF)
        p = 0
        positions = cidx.size > 0
        for j in range(cval.size):
            m = bits[j] & mask
            if m > kth or (m == kth and ties > 0):
                if m == kth:
                    ties -= 1
                out_idx[o + p] = cidx[j] if positions else base + j
                out_val[o + p] = cval[j]
                p += 1

    @njit(cache=True)
    def _segments_topk(a, los, ns, ks, offs, spos, soffs, ranks, floor, out_idx, out_val):
        for i in range(los.size):
            _segment_topk(a, los[i], ns[i], ks[i], spos[soffs[i]:soffs[i + 1]], ranks[i],
                          floor, out_idx, out_val, offs[i])

    @njit(parallel=True, cache=True)
    def _segments_topk_par(a, los, ns, ks, offs, spos, soffs, ranks, floor, out_idx,
                           out_val):
        for i in prange(los.size):
            _segment_topk(a, los[i], ns[i], ks[i], spos[soffs[i]:soffs[i + 1]], ranks[i],
                          floor, out_idx, out_val, offs[i])

    @njit(cache=True)
    def _set_at(target, idx, vals):
        for j in range(idx.size):
            target[idx[j]] = vals[j]

    @njit(fastmath=FASTMATH, cache=True)
    def _add_zero_chunk(g, r):
        for i in range(r.size):
            r[i] += g[i]
            g[i] = 0.0

    @njit(parallel=True, cache=True)
    def _add_zero_par(g, r, chunk):
        for c in prange((r.size + chunk - 1) // chunk):
            lo = c * chunk
            hi = min(r.size, lo + chunk)
            _add_zero_chunk(g[lo:hi], r[lo:hi])

    @njit(cache=True)
    def _histogram_chunk(bits, h, shift):
        h[:] = 0
        for i in range(bits.size):
            h[(bits[i] & 0x7FFFFFFF) >> shift] += 1

    @njit(cache=True)
    def _histogram_within(bits, h, shift, within_shift, within):
        mask = h.size - 1
        for i in range(bits.size):
            a = bits[i] & 0x7FFFFFFF
            if (a >> within_shift) == within:
                h[(a >> shift) & mask] += 1

    @njit(parallel=True, cache=True)
    def _histogram_par(bits, hist, chunk, shift):
        for c in prange(hist.shape[0]):
            lo = c * chunk
            _histogram_chunk(bits[lo:min(bits.size, lo + chunk)], hist[c], shift)


def _threads():
    """Follow torch's thread count (OMP_NUM_THREADS, torch.set_num_threads): extra spinning
    threads on oversubscribed cores, as with several ranks per machine, cost far more than
    they give."""
    want = min(numba.config.NUMBA_NUM_THREADS, torch.get_num_threads())
    if want <= 1:
        return 1  # never start numba's pool (its idle OpenMP workers would spin)
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)
    return want


def _chunks(n: int):
    """Chunk count and length (a multiple of BLOCK) for ``n`` entries."""
    threads = _threads()
    nchunks = 1 if threads == 1 else max(1, min(threads * 4, (n + 65535) // 65536))
    chunk = -(-max(n, 1) // nchunks)
    chunk = -(-chunk // BLOCK) * BLOCK
    return -(-max(n, 1) // chunk), chunk


def _np(t):
    if t is None:
        return None
    if t.dtype != torch.float32:
        raise TypeError("the numba kernels take float32")
    return t.detach().contiguous().numpy()


class Scan(NamedTuple):
    count: int
    nonfinite: bool
    energy: float  # sum of acc^2 (the compression-error statistic needs no extra pass)
    idx: torch.Tensor  # the candidates, in index order, when all of them fitted
    values: torch.Tensor
    complete: bool
    args: tuple  # to scan again with exact room when they did not


def _room(caps):
    """Where each chunk's candidates start in one output array, and its length: ``caps[c]``
    slots per chunk plus the spare one ``_scan_chunk`` writes after them."""
    starts = np.zeros(caps.size, dtype=np.int64)
    np.cumsum(caps[:-1] + 1, out=starts[1:])
    return starts, int(caps.sum()) + caps.size


def _run_scan(gn, rn, thi, tlo, caps, into=None):
    nchunks, chunk = _chunks(rn.size)
    starts, total = _room(caps)
    out_idx = np.empty(total, dtype=np.int64)
    out_val = np.empty(total, dtype=np.float32)
    counts = np.empty(nchunks, dtype=np.int64)
    energies = np.empty(nchunks, dtype=np.float64)
    if nchunks == 1:  # on the calling thread: numba's pool stays asleep
        counts[0], energies[0] = _scan_chunk(gn, rn, thi, tlo, 0, out_idx, out_val, 0, caps[0],
                                             into)
    else:
        _scan_par(gn, rn, thi, tlo, chunk, out_idx, out_val, starts, caps, counts, energies,
                  into)
    return counts, energies, starts, out_idx, out_val


def scan(g, r, t_hi, t_lo, expect=None, into=None) -> Scan:
    """Count ``acc >= t_hi or acc <= -t_lo``, look for NaN/Inf and collect the candidates, in
    one read of ``g`` and ``r`` (writes nothing to them). ``expect``: about how many candidates
    there will be (room for twice that is made; more costs a second pass). ``into`` (with a
    gradient; a float32 buffer of the same length, or ``g`` itself): ``acc`` is written there
    in the same pass (4 bytes per entry more instead of a later pass of 12, see
    :class:`AccumulatingOps`)."""
    gn, rn = _np(g), _np(r)
    into_n = None if into is None or gn is None else _np(into)
    if into_n is not None and into_n.ctypes.data == gn.ctypes.data:
        gn = None  # in place: the kernel reads g from ``into`` and writes acc back
    thi, tlo = np.float32(t_hi), np.float32(t_lo)
    nchunks, chunk = _chunks(rn.size)
    room = (rn.size // 32 if expect is None else 2 * int(expect)) + 4096
    caps = np.full(nchunks, -(-room // nchunks) + BLOCK, dtype=np.int64)
    counts, energies, starts, out_idx, out_val = _run_scan(gn, rn, thi, tlo, caps, into_n)
    if into_n is not None:  # a second scan reads acc alone (``g`` may hold it now)
        gn, rn = None, into_n
    complete = bool((counts <= caps).all())
    count = int(counts.sum())
    if complete:
        if nchunks == 1:
            idx, val = out_idx[:count], out_val[:count]
        else:
            idx = np.concatenate([out_idx[s:s + c] for s, c in zip(starts, counts)])
            val = np.concatenate([out_val[s:s + c] for s, c in zip(starts, counts)])
        cidx, cval = torch.from_numpy(idx), torch.from_numpy(val)
    else:
        cidx = cval = None
    energy = float(energies.sum())
    return Scan(count, not np.isfinite(energy), energy, cidx, cval, complete,
                (gn, rn, thi, tlo, counts))


def scan_parts(parts, r, t_hi, t_lo, expect, into, minus=None, reset=False) -> Scan:
    """:func:`scan` of ``acc = g + r`` where ``g`` lies in pieces (a bucket's ``p.grad``, each
    with its offset in the bucket: ``(numpy float32 array, offset)``, in order, covering it),
    writing ``acc`` into ``into``: the concatenation of the pieces is never made. On the
    calling thread (numba cannot run a Python list of arrays in parallel). ``minus`` (float32,
    the bucket's length): ``g`` is each piece minus it, ``acc = (piece - minus) + r``; with
    ``reset`` each piece is set to ``minus`` in the same pass."""
    rn, into_n = _np(r), _np(into)
    mn = None if minus is None else _np(minus)
    n = rn.size
    thi, tlo = np.float32(t_hi), np.float32(t_lo)
    # one output shared by the pieces, each appending after the last (they run one after
    # another): a piece holds as many candidates as it has, not its share of the bucket's
    # length (a small output layer of large gradients overflowed a share and forced a scan
    # of the whole bucket again)
    room = (n // 32 if expect is None else 2 * int(expect)) + 4096
    out_idx = np.empty(room + 1, dtype=np.int64)  # + the spare slot _scan_chunk writes
    out_val = np.empty(room + 1, dtype=np.float32)
    counts = np.empty(len(parts), dtype=np.int64)
    energy = 0.0
    fill = 0
    for j, (g, off) in enumerate(parts):
        hi = off + g.size
        counts[j], e = _scan_chunk(g, rn[off:hi], thi, tlo, off, out_idx, out_val, fill,
                                   room - fill, into_n[off:hi],
                                   None if mn is None else mn[off:hi], reset and mn is not None)
        fill += min(int(counts[j]), room - fill)
        energy += e
    count = int(counts.sum())
    if count > room:  # the room was short: acc is written, scan it alone
        s = scan(None, into, t_hi, t_lo, count)
        return s._replace(energy=energy, nonfinite=not np.isfinite(energy))
    return Scan(count, not np.isfinite(energy), energy, torch.from_numpy(out_idx[:count]),
                torch.from_numpy(out_val[:count]), True, (None, into_n, thi, tlo, counts))


def sample_parts(parts, r, positions: np.ndarray, minus=None) -> np.ndarray:
    """:func:`sample` where ``g`` lies in pieces, less ``minus`` where given (see
    :func:`scan_parts`); ``positions`` ascending."""
    rn = _np(r)
    out = np.empty(positions.size, dtype=np.float32)
    mn = None if minus is None else _np(minus)
    done = 0
    for g, off in parts:
        a, e = np.searchsorted(positions, [off, off + g.size])
        if a > done:  # positions no piece covers: r alone
            _sample_acc(None, 0, rn, None, positions[done:a], out[done:a])
        if e > a:
            _sample_acc(g, off, rn, mn, positions[a:e], out[a:e])
        done = max(done, e)
    if done < positions.size:
        _sample_acc(None, 0, rn, None, positions[done:], out[done:])
    return out


class AccumulatingOps:
    """These primitives for one uplink selection from ``acc = g + r``, whose first scan of
    ``(g, r)`` also writes ``acc`` into ``into``: the uplink commit is then the O(k) write of
    the selected positions and an exchange of buffers instead of a pass of its own (reading
    ``g`` and ``r`` and writing ``r``), and any later scan, sample or threshold of the same
    selection reads ``acc`` alone. ``into`` may be ``g`` when ``g`` is a buffer nothing else
    reads. ``written`` says whether it happened (a method may decide without a scan, or give
    up after one and take the plain path)."""

    def __init__(self, g, r, into, parts=None, minus=None, reset=False):
        self.g, self.r, self.into = g, r, into
        self.written = False
        # with ``minus``: the first scan also sets the pieces to ``minus`` (parameters back
        # at the anchor); ``reset_done`` says it did, after which the pieces no longer hold g
        self.reset = reset
        self.reset_done = False
        # ``g`` (= ``into``) not filled yet: the gradient lies in these pieces, (tensor,
        # offset) in order, which the first scan reads instead of their concatenation
        self.parts = parts
        # with ``parts``: ``g`` is the pieces less this (a weight change, params - anchor)
        self.minus = minus
        self.read_pieces = False  # whether the first scan read them

    @property
    def pending(self) -> bool:
        """Is ``g`` still to be filled from its pieces?"""
        return self.parts is not None

    def materialize(self) -> None:
        """Concatenate the pieces into ``g`` (for whatever reads ``g`` other than a scan)."""
        if self.parts is None:
            return
        if self.minus is None:
            torch.cat([t.reshape(-1) for t, _ in self.parts], out=self.g)
        else:
            for t, off in self.parts:
                n = t.numel()
                torch.sub(t.reshape(-1), self.minus[off:off + n], out=self.g[off:off + n])
        self.parts = None

    def __getattr__(self, attr):  # every other primitive is the module's own
        try:
            fn = globals()[attr]
        except KeyError:
            raise AttributeError(attr) from None
        if not callable(fn) or isinstance(fn, type):
            return fn

        def reading_g(*args, **kwargs):
            if self.parts is not None and any(a is self.g for a in args):
                self.materialize()
            return fn(*args, **kwargs)
        return reading_g

    def _reads(self, g, r):
        if self.written and g is self.g and r is self.r:
            return None, self.into
        return g, r

    def _pieces(self):
        return [(_np(t).reshape(-1), off) for t, off in self.parts]

    def scan(self, g, r, t_hi, t_lo, expect=None):
        if not self.written and g is self.g and r is self.r:
            if self.parts is not None:
                s = scan_parts(self._pieces(), r, t_hi, t_lo, expect, self.into, self.minus,
                               self.reset)
                self.parts, self.read_pieces = None, True
                self.reset_done = self.reset and self.minus is not None
            else:
                s = scan(g, r, t_hi, t_lo, expect, into=self.into)
            self.written = True
            return s
        if g is self.g and self.parts is not None:
            self.materialize()
        return scan(*self._reads(g, r), t_hi, t_lo, expect)

    def sample(self, g, r, positions):
        if self.parts is not None and g is self.g and r is self.r \
                and bool((np.diff(positions) > 0).all()):
            return sample_parts(self._pieces(), r, positions, self.minus)
        if g is self.g:
            self.materialize()
        return sample(*self._reads(g, r), positions)

    def kth_magnitude(self, g, r, k):
        if g is self.g:
            self.materialize()
        return kth_magnitude(*self._reads(g, r), k)

    def segmented_topk(self, g, r, segments, counts):
        if g is self.g:
            self.materialize()
        return segmented_topk(*self._reads(g, r), segments, counts)


def gather(g, r, s: Scan):
    """The candidates of scan ``s`` as (int64 indices, float32 acc values), in index order."""
    if s.complete:
        return s.idx, s.values
    gn, rn, thi, tlo, counts = s.args  # the room was short: once more with exact room
    _, _, starts, out_idx, out_val = _run_scan(gn, rn, thi, tlo, counts.astype(np.int64))
    idx = np.concatenate([out_idx[a:a + c] for a, c in zip(starts, counts)])
    val = np.concatenate([out_val[a:a + c] for a, c in zip(starts, counts)])
    return torch.from_numpy(idx), torch.from_numpy(val)


def sample(g, r, positions: np.ndarray) -> np.ndarray:
    """``acc`` at the given positions, on the host (float32)."""
    out = np.empty(positions.size, dtype=np.float32)
    _sample_acc(_np(g), 0, _np(r), None, positions, out)
    return out


def kth_magnitude(g, r, k: int) -> np.float32:
    """A float32 ``t`` with at least ``k`` entries ``|acc| >= t`` and at most those of the bin of
    the k-th largest magnitude: the floor of that bin in a 16-bit radix histogram of the float
    bits (for non-negative floats the bit pattern orders like the value)."""
    rn = _np(r)
    acc = rn if g is None else _np(g) + rn
    if acc.size <= 1 << 16:  # short: an exact partition is cheaper than 65,536 bins
        mag = np.abs(acc)
        return np.partition(mag, mag.size - k)[mag.size - k]
    bits = acc.view(np.uint32)
    nchunks, chunk = _chunks(bits.size)
    hist = np.empty((nchunks, BINS), dtype=np.int64)
    if nchunks == 1:
        _histogram_chunk(bits, hist[0], 16)
    else:
        _histogram_par(bits, hist, chunk, 16)
    from_top = np.cumsum(hist.sum(axis=0)[::-1])
    b = BINS - 1 - int(np.searchsorted(from_top, k))
    return np.array([b << 16], dtype=np.uint32).view(np.float32)[0]


def pick_topk(cidx: torch.Tensor, cval: torch.Tensor, k: int, sign: int = 0):
    """The k largest of the candidates (by ``|v|``, or by ``sign * v`` among those of that
    sign, of which there must be at least k), ties by lowest index; candidates come in index
    order and so do the results."""
    if k >= cval.numel():
        return cidx, cval
    if k <= 0:
        return cidx[:0], cval[:0]
    idx, val = _pick(cidx.numpy(), cval.numpy(), k, sign)
    return torch.from_numpy(idx), torch.from_numpy(val)


def split_sides(cidx: np.ndarray, cval: np.ndarray):
    """The candidates above zero and the others, each in its given order: (positive indices,
    values, other indices, values), numpy arrays."""
    return _split_sides(cidx, cval)


def pick_sides(cidx: torch.Tensor, cval: torch.Tensor, k: int):
    """The k largest positive and the k largest negative candidates (a sign with at most k
    gives all of them; none is zero), in one split and a pick over each side."""
    pi, pv, ni, nv = _split_sides(cidx.numpy(), cval.numpy())
    sides = []
    for i, v in ((pi, pv), (ni, nv)):
        if k < v.size:
            i, v = _pick(i, v, k, 0)
        sides += [torch.from_numpy(i), torch.from_numpy(v)]
    return tuple(sides)


def commit(g, r, idx, remainder, zero_grad=False) -> None:
    """``r += g`` (and ``g = 0`` in the same pass when asked), then ``r[idx] = remainder``."""
    if g is not None:
        if zero_grad:
            gn, rn = _np(g), _np(r)
            nchunks, chunk = _chunks(rn.size)
            if nchunks == 1:
                _add_zero_chunk(gn, rn)
            else:
                _add_zero_par(gn, rn, chunk)
        else:
            r.add_(g)
    if idx.numel():
        _set_at(_np(r), idx.numpy(), _np(remainder))


def scatter_add(target, idx, vals, scale: float, read: bool = False):
    """``target[idx] += vals * scale`` (indices unique: the order of the writes does not
    matter); ``read``: also return the written entries' new values (a numpy array) and
    whether one of them is NaN/Inf."""
    if vals.dtype != torch.float32 or target.dtype != torch.float32:
        reference.scatter_add(target, idx, vals, scale)
        if read:
            out = target[idx].numpy()
            return out, not bool(np.isfinite(out).all())
        return None
    args = (_np(target), idx.numpy(), vals.contiguous().numpy(), np.float32(scale))
    if not read:
        return _scatter_add(*args)
    out = np.empty(idx.numel(), dtype=np.float32)
    return out, _scatter_add_read(*args, out)


def scatter_add_twin(target, twin, idx, vals, scale: float) -> None:
    """``target[idx] += vals * scale`` and ``twin[idx] = target[idx]`` (indices unique): a
    weight change added to the anchor and written to the parameters, which stood at the anchor
    at those positions."""
    if vals.dtype != torch.float32 or target.dtype != torch.float32 \
            or twin.dtype != torch.float32 or not available():
        reference.scatter_add(target, idx, vals, scale)
        reference.set_at(twin, idx, target[idx])
        return
    _scatter_add_twin(_np(target), _np(twin), idx.numpy(), vals.contiguous().numpy(),
                      np.float32(scale))


#: up to this many payloads the support is merged (O(P) per position); beyond, scattered
MERGE_MAX_PAYLOADS = 16


def support_sum(payloads, scale: float, dtype, device, scratch):
    """The aggregate's non-zero values (payloads summed in rank order), in O(P k) and without
    a full-length pass. Up to :data:`MERGE_MAX_PAYLOADS` float32 payloads are merged by
    position (:func:`_merged_sums`: sequential reads only, no scratch); otherwise they are
    scattered into ``scratch()`` (an all-zero float32 tensor of the bucket's length, left all
    zero again), which costs four random touches per entry."""
    full = [p for p in payloads if p.indices.numel()]
    total = sum(p.indices.numel() for p in full)
    out = np.empty(total, dtype=np.float32)
    if not full:
        return torch.from_numpy(out)
    if len(full) <= MERGE_MAX_PAYLOADS and all(p.values.dtype == torch.float32 for p in full):
        idx = np.concatenate([p.indices.numpy() for p in full])
        vals = np.concatenate([p.values.contiguous().numpy() for p in full])
        starts = np.zeros(len(full) + 1, dtype=np.int64)
        starts[1:] = np.cumsum([p.indices.numel() for p in full])
        return torch.from_numpy(out[:_merged_sums(idx, vals, starts, np.float32(scale), out)])
    target = scratch()
    for p in full:
        scatter_add(target, p.indices, p.values, scale)
    pos = 0
    for p in full:
        pos = _support_values(_np(target), p.indices.numpy(), out, pos)
    return torch.from_numpy(out[:pos])


def position_marks(n: int) -> np.ndarray:
    """An all-zero bit set over ``n`` positions, for :func:`candidates`."""
    return np.zeros((n + 63) // 64, dtype=np.uint64)


def candidates(lists, bound, mark, bound_neg=None):
    """Each position of (int64 index, float32 value) lists, newest first, once, with its
    newest value, kept when ``|v| >= bound`` (given ``bound_neg``: ``v >= bound`` or
    ``v <= -bound_neg``); ``mark`` (all zero) is left all zero."""
    total = sum(i.size for i, _ in lists)
    out_idx = np.empty(total + 1, dtype=np.int64)
    out_val = np.empty(total + 1, dtype=np.float32)
    p = 0
    bound = np.float32(bound)
    bound_neg = bound if bound_neg is None else np.float32(bound_neg)
    for idx, val in lists:
        p = _collect(idx, val, bound, bound_neg, mark, out_idx, out_val, p)
    mark[:] = 0
    return out_idx[:p], out_val[:p]


def candidate_sides(lists, bound, mark, bound_neg):
    """:func:`candidates` (with ``bound_neg``) split by sign as they are collected: (indices,
    values above zero, indices, values of the others), each in list order."""
    total = sum(i.size for i, _ in lists)
    pi = np.empty(total + 1, dtype=np.int64)
    pv = np.empty(total + 1, dtype=np.float32)
    ni = np.empty(total + 1, dtype=np.int64)
    nv = np.empty(total + 1, dtype=np.float32)
    p = q = 0
    bound, bound_neg = np.float32(bound), np.float32(bound_neg)
    for idx, val in lists:
        p, q = _collect_sides(idx, val, bound, bound_neg, mark, pi, pv, p, ni, nv, q)
    mark[:] = 0
    return pi[:p], pv[:p], ni[:q], nv[:q]


def pick_unordered(cidx, cval, k):
    """The Top-K of candidates in any order (ties by lowest index), in candidate order, and
    the candidates left: (indices, values, rest indices, rest values), numpy arrays."""
    return _pick_unordered(cidx, cval, k)


def outside(cidx, cval, sidx, mark):
    """Entries of candidates (cidx, cval), in any order, whose index is not in ``sidx`` (any
    order); ``mark`` (all zero) is left all zero."""
    out_idx, out_val = _outside(cidx, cval, np.ascontiguousarray(sidx, dtype=np.int64), mark)
    return out_idx, out_val


def largest(idx, val, k, bound):
    """Entries of (idx, val), in any order, with ``|v|`` at or above ``bound`` and among the
    k largest (ties kept), with the resulting cut: (indices, values, cut)."""
    return _largest(idx, val, k, np.float32(bound))


def group(idx, vals, edges: np.ndarray):
    """Split a selection (int64 indices in any order, float32 values) by the ranges between
    ``edges`` (ascending int64, first 0, last the length), e.g. a bucket's parameters: no
    sort. Returns (indices relative to each range, values, starts: group j is
    ``[starts[j], starts[j + 1])``), torch tensors and a numpy array."""
    out_idx, out_val, starts = _group(idx.numpy(), vals.contiguous().numpy(), edges)
    return torch.from_numpy(out_idx), torch.from_numpy(out_val), starts


def set_at(target, idx, vals) -> None:
    """``target[idx] = vals``."""
    if vals.dtype != target.dtype or target.dtype != torch.float32:
        return reference.set_at(target, idx, vals)
    _set_at(_np(target), idx.numpy(), vals.contiguous().numpy())


@functools.lru_cache(maxsize=256)
def _segment_plan(segments, counts):
    """What :func:`segmented_topk` needs per segment, made once per bucket and density:
    starts, lengths, counts, output offsets, the fixed samples (positions relative to each
    segment, concatenated, with their offsets) and the rank in a sample that puts the
    threshold where about 1.6 k of the segment reach it (:func:`.select.sampled_threshold`'s
    margin; 0: no sample)."""
    from .select import sample_positions

    los = np.array([lo for lo, _ in segments], dtype=np.int64)
    ns = np.array([hi - lo for lo, hi in segments], dtype=np.int64)
    ks = np.minimum(np.array(counts, dtype=np.int64), ns)  # a short segment gives all it has
    offs = np.zeros(len(segments) + 1, dtype=np.int64)
    np.cumsum(ks, out=offs[1:])
    samples, ranks = [], []
    for n, k in zip(ns.tolist(), ks.tolist()):
        pos = sample_positions(n)
        rank = 0
        if pos is not None and 0 < k < n:
            expected = pos.size * k / n
            rank = int(np.ceil(1.6 * expected + 4.0 * np.sqrt(expected) + 8))
            rank = rank if rank < pos.size else 0
        samples.append(pos if rank else np.empty(0, dtype=np.int64))
        ranks.append(rank)
    soffs = np.zeros(len(segments) + 1, dtype=np.int64)
    np.cumsum([s.size for s in samples], out=soffs[1:])
    spos = np.concatenate(samples).astype(np.int64)
    return los, ns, ks, offs, spos, soffs, np.array(ranks, dtype=np.int64)


def segmented_topk(g, r, segments, counts):
    """Each segment's own exact Top-K of ``|g + r|`` (``counts[i]`` of segment ``i``, ties by
    lowest index), all segments in one call: (int64 indices ascending, float32 acc values).
    The layer-wise selection of a bucket of several tensors (``layer_floor=1``), without a
    Python round per tensor. Reads only; NaN/Inf must have been ruled out."""
    a = _np(r) if g is None else _np(g) + _np(r)
    los, ns, ks, offs, spos, soffs, ranks = _segment_plan(tuple(segments), tuple(counts))
    total = int(offs[-1])
    out_idx = np.empty(total, dtype=np.int64)
    out_val = np.empty(total, dtype=np.float32)
    from .select import tiny

    floor = tiny()
    if _threads() > 1 and los.size > 1:
        _segments_topk_par(a, los, ns, ks, offs, spos, soffs, ranks, floor, out_idx, out_val)
    else:
        _segments_topk(a, los, ns, ks, offs, spos, soffs, ranks, floor, out_idx, out_val)
    return torch.from_numpy(out_idx), torch.from_numpy(out_val)


def magnitude_histogram(r, shift: int, bins: int, within_shift: int = 31,
                        within: int = 0) -> torch.Tensor:
    """Counts of ``|r|`` per bin of its float32 bits: bin ``(bits >> shift) % bins`` of the
    entries whose ``bits >> within_shift`` equals ``within`` (all of them by default; bins
    order like magnitudes), as float64 (exact to 2**53, summable by any transport)."""
    if r.dtype != torch.float32:
        return reference.magnitude_histogram(r, shift, bins, within_shift, within)
    hist = np.zeros(bins, dtype=np.int64)
    _histogram_within(_np(r).view(np.uint32), hist, shift, within_shift, within)
    return torch.from_numpy(hist.astype(np.float64))


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel, serial and threaded variants."""
    if not HAVE_NUMBA:
        return
    import sys

    from . import select

    me = sys.modules[__name__]
    g = torch.randn(1 << 18)
    for threads in (1, 2):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for grad in (g, None):
                r = torch.randn(1 << 18) * 0.1
                select.topk(me, grad, r, 100)
                select.topk(me, grad, r, 1 << 17)
                select.sbc(me, grad, r, 100)
                kth_magnitude(grad, r, 100)
            own = g.clone()  # the uplink's scans that write acc: into a spare, in place
            select.topk(AccumulatingOps(g, r, torch.empty_like(r)), g, r, 100)
            select.topk(AccumulatingOps(own, r, own), own, r, 100)
            pieces = [(g[:1000], 0), (g[1000:], 1000)]
            select.topk(AccumulatingOps(own, r, own, pieces), own, r, 100)
            anchor = g.clone()  # a weight change read as params - anchor, params then reset
            select.topk(AccumulatingOps(own, r, own, [(g.clone(), 0)], anchor, True), own, r,
                        100)
            group(torch.arange(10), torch.ones(10), np.array([0, 4, 10], dtype=np.int64))
            # the downlink watch's primitives (kernels/watch.py)
            idx, val = np.arange(0, 1000, 3, dtype=np.int64), np.linspace(-1, 1, 334,
                                                                          dtype=np.float32)
            scatter_add(r, torch.from_numpy(idx), torch.from_numpy(val), 1.0, read=True)
            mark = position_marks(r.numel())
            candidates([(idx, val)], 0.5, mark)
            pick_unordered(idx, val, 10)
            candidates([(idx, val)], 0.5, mark, 0.25)
            split_sides(idx, val)
            outside(idx, val, idx[:5], mark)
            largest(idx, val, 10, 0.1)
        finally:
            torch.set_num_threads(old)
    from .. import golomb
    golomb.decode(golomb.encode(np.array([1, 5, 90]), 3), 3, 3)
