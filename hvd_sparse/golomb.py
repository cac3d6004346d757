"""Golomb-Rice coding of sorted positions, as gaps (Sattler et al.'s position code for SBC).

Positions ``i_0 < i_1 < ...`` become gaps ``g_0 = i_0``, ``g_j = i_j - i_{j-1} - 1``. Each gap is
written as its quotient ``g >> b`` in unary (that many 1s, then a 0) followed by its remainder's
``b`` low bits. For positions drawn at density ``p`` the gaps are geometric, and the parameter

    b* = 1 + floor(log2(log(phi - 1) / log(1 - p))),  phi the golden ratio,

makes the code near-optimal; its mean length is ``b* + 1 / (1 - (1 - p) ** (2 ** b*))`` bits per
position (11.49 at p = 0.001, against an entropy bound of H(p)/p = 11.41).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .kernels import reference

PHI = (1 + 5 ** 0.5) / 2


def optimal_parameter(density: float) -> int:
    """Sattler et al.'s b* for positions at the given density (0 for density >= ~0.38)."""
    if density <= 0:
        return 0
    if density >= 1:
        return 0
    ratio = math.log(PHI - 1) / math.log1p(-density)  # log1p: exact for tiny densities
    return max(0, 1 + math.floor(math.log2(ratio))) if ratio > 0 else 0


def expected_bits_per_position(density: float, b: int = None) -> float:
    """Mean code length per position for i.i.d. positions at ``density``."""
    b = optimal_parameter(density) if b is None else b
    return b + 1.0 / (1.0 - (1.0 - density) ** (2 ** b))


def entropy_bits_per_position(density: float) -> float:
    """The bound: binary entropy of the mask divided by the density."""
    p = density
    if p <= 0 or p >= 1:
        return 0.0
    return (-p * math.log2(p) - (1 - p) * math.log2(1 - p)) / p


def encode(positions, b: int) -> bytes:
    """Code ascending, unique non-negative positions; returns the packed bit string."""
    t = torch.as_tensor(np.asarray(positions, dtype=np.int64))
    return encode_tensor(t, b).numpy().tobytes()


def encode_tensor(positions: torch.Tensor, b: int) -> torch.Tensor:
    """:func:`encode` on the positions' own device, as a uint8 tensor there: so positions
    selected on a GPU are coded on it (vectorised) and only the stream's length is read by the
    host; on the CPU one compiled sequential pass when numba is there."""
    if positions.device.type == "cpu" and _pack is not None:
        pos = positions.to(torch.int64).reshape(-1).contiguous().numpy()
        out, total = _pack(pos, b)
        if total < 0:
            raise ValueError("positions must be strictly increasing and non-negative")
        return torch.from_numpy(out)
    return encode_vectorised(positions, b)


def encode_vectorised(positions: torch.Tensor, b: int) -> torch.Tensor:
    """The coder as tensor operations on any device: a bit array built with a few scatters,
    then packed eight bits to a byte, most significant first."""
    device = positions.device
    pos = positions.to(torch.int64).reshape(-1)
    if pos.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    gaps = torch.diff(pos, prepend=pos.new_full((1,), -1)) - 1
    q = gaps >> b
    lengths = q + (1 + b)
    ends = torch.cumsum(lengths, 0)
    total, smallest = torch.stack([ends[-1], gaps.min()]).tolist()  # one host read
    if smallest < 0:
        raise ValueError("positions must be strictly increasing and non-negative")
    starts = ends - lengths
    nbits = -(-total // 8) * 8
    bits = torch.zeros(nbits, dtype=torch.uint8, device=device)
    ones = int(total - pos.numel() * (1 + b))  # unary part: q ones from each start
    if ones:
        # the t-th one overall lies in codeword j, at starts[j] + t - (ones before codeword j)
        shift = torch.repeat_interleave(starts - (torch.cumsum(q, 0) - q), q, output_size=ones)
        bits[torch.arange(ones, device=device) + shift] = 1
    if b:  # remainder: b bits after the terminating zero, most significant first
        shifts = torch.arange(b - 1, -1, -1, device=device)
        where = (starts + q + 1).unsqueeze(1) + torch.arange(b, device=device)
        bits[where.reshape(-1)] = ((gaps & ((1 << b) - 1)).unsqueeze(1) >> shifts
                                   & 1).to(torch.uint8).reshape(-1)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int32, device=device)
    return (bits.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)


try:  # the coder's sequential forms: compiled when numba is there
    from numba import njit

    _MASK63 = (1 << 63) - 1

    @njit(cache=True, inline="always")
    def _put32(out, o, v):
        """The 32 low bits of ``v`` at ``out[o:o + 4]``, most significant byte first."""
        out[o] = (v >> 24) & 255
        out[o + 1] = (v >> 16) & 255
        out[o + 2] = (v >> 8) & 255
        out[o + 3] = v & 255

    @njit(cache=True, inline="always")
    def _flush(out, o, acc, nacc):
        """Write the accumulator's oldest 32 bits once it holds 32 or more (it never holds
        more than 63: callers append at most 32 bits to at most 31)."""
        if nacc >= 32:
            _put32(out, o, acc >> (nacc - 32))
            o += 4
            nacc -= 32
            acc &= (1 << nacc) - 1
        return o, acc, nacc

    @njit(cache=True)
    def _pack(pos, b):
        """One sizing pass, then one coding pass that appends a whole codeword at a time to a
        bit accumulator written out 4 bytes at a time; a codeword longer than 32 bits (a long
        quotient, or b > 31) is appended 31 bits at a time. Few branches per position, and no
        data-dependent loop in the common case."""
        total, prev = 0, -1
        for j in range(pos.size):
            gap = pos[j] - prev - 1
            if gap < 0:
                return np.empty(0, dtype=np.uint8), -1
            total += (gap >> b) + 1 + b
            prev = pos[j]
        out = np.zeros((total + 7) // 8, dtype=np.uint8)
        o, acc, nacc, prev, mask = 0, 0, 0, -1, (1 << b) - 1
        for j in range(pos.size):
            gap = pos[j] - prev - 1
            prev = pos[j]
            q = gap >> b
            length = q + 1 + b
            if length <= 32:  # q ones, a zero, b remainder bits, in one append
                acc = (acc << length) | ((((1 << q) - 1) << (b + 1)) | (gap & mask))
                nacc += length
                if nacc >= 32:  # (_flush written out: numba compiles this loop 2x faster)
                    _put32(out, o, acc >> (nacc - 32))
                    o += 4
                    nacc -= 32
                    acc &= (1 << nacc) - 1
                continue
            while q > 0:
                c = min(q, 31)
                o, acc, nacc = _flush(out, o, (acc << c) | ((1 << c) - 1), nacc + c)
                q -= c
            rem, left = gap & mask, b + 1  # the zero, then the remainder's bits
            while left > 0:
                c = min(left, 31)
                o, acc, nacc = _flush(out, o, (acc << c) | ((rem >> (left - c)) & ((1 << c) - 1)),
                                      nacc + c)
                left -= c
        while nacc >= 8:
            nacc -= 8
            out[o] = (acc >> nacc) & 255
            o += 1
        if nacc:
            out[o] = (acc << (8 - nacc)) & 255
        return out, total


    @njit(cache=True)
    def _walk(data, count, b, leading_ones):
        """Decode ``count`` codewords; returns (positions, how many were whole). A 63-bit window
        (held in an int64, most significant bit first at bit 62, refilled 4 bytes at a time)
        gives the quotient from a table on its top byte and the remainder by one shift; a
        quotient of 8 or more, or a codeword past the window, goes bit by bit."""
        out = np.empty(count, dtype=np.int64)
        nbytes = data.size
        n = nbytes * 8
        buf, nbits, byte, used, prev = 0, 0, 0, 0, -1
        mask = (1 << b) - 1
        for j in range(count):
            if nbits < 32:  # refill: 4 bytes below the valid bits (63-bit window, MSB at bit 62)
                if byte + 4 <= nbytes:
                    w = (np.int64(data[byte]) << 24) | (np.int64(data[byte + 1]) << 16) | \
                        (np.int64(data[byte + 2]) << 8) | np.int64(data[byte + 3])
                    buf |= w << (31 - nbits)
                    nbits += 32
                    byte += 4
                else:
                    while byte < nbytes and nbits <= 55:
                        buf |= np.int64(data[byte]) << (55 - nbits)
                        nbits += 8
                        byte += 1
            q = leading_ones[buf >> 55]
            if q < 8 and q + 1 + b <= nbits:
                c = q + 1 + b
                if used + c > n:
                    return out, j
                rem = (buf >> (63 - c)) & mask
                buf = (buf << c) & _MASK63
                nbits -= c
                used += c
            else:  # a long quotient or the window's end: bit by bit
                q = 0
                while True:
                    if used >= n:
                        return out, j
                    if nbits == 0:
                        while byte < nbytes and nbits <= 55:
                            buf |= np.int64(data[byte]) << (55 - nbits)
                            nbits += 8
                            byte += 1
                    bit = buf >> 62
                    buf = (buf << 1) & _MASK63
                    nbits -= 1
                    used += 1
                    if bit == 0:
                        break
                    q += 1
                if used + b > n:
                    return out, j
                rem = 0
                for _ in range(b):
                    if nbits == 0:
                        while byte < nbytes and nbits <= 55:
                            buf |= np.int64(data[byte]) << (55 - nbits)
                            nbits += 8
                            byte += 1
                    rem = (rem << 1) | (buf >> 62)
                    buf = (buf << 1) & _MASK63
                    nbits -= 1
                    used += 1
            prev = prev + 1 + (q << b) + rem
            out[j] = prev
        return out, count

    _LEADING_ONES = np.array([8 - len(bin(255 - v)) + 2 if v != 255 else 8 for v in range(256)],
                             dtype=np.int64)
except ImportError:  # pragma: no cover - depends on the installation
    _pack = _walk = None


def decode_tensor(stream: torch.Tensor, count: int, b: int):
    """Inverse of :func:`encode_tensor` on the stream's own device with no host read, so a
    GPU decodes the positions it received where they lie: ``(positions, complete)``, where
    ``complete`` is a 0-dim bool tensor, False when the stream ends before ``count`` codewords
    (the caller folds it into a host read it makes anyway).

    A sequential walk does not map onto a GPU, so the codeword starts are found by doubling
    instead. Every bit position ``s`` has a successor: the bit after the first zero at or after
    ``s``, plus ``b`` (where the next codeword would start if one started at ``s``). Start 0 is
    known; round ``r`` finds starts ``2**r .. 2**(r+1) - 1`` by one jump of ``2**r`` codewords
    from the first ``2**r``, and squares the jump. That is ``ceil(log2(count))`` rounds of
    gathers (O(bits log count) work, no atomics, so the same result on every device)."""
    device = stream.device
    if count == 0:
        return (torch.empty(0, dtype=torch.int64, device=device),
                torch.ones((), dtype=torch.bool, device=device))
    n = stream.numel() * 8
    if n == 0:
        return (torch.zeros(count, dtype=torch.int64, device=device),
                torch.zeros((), dtype=torch.bool, device=device))
    broken = n + 1  # the successor of a start whose codeword does not fit in the stream
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=device)
    bits = ((stream.reshape(-1, 1) >> shifts) & 1).reshape(-1)
    zero = bits == 0
    # the first zero at or after each bit: the zeros in order (padded with n), indexed by how
    # many zeros come before the bit
    before = torch.cumsum(zero, 0) - zero.to(torch.int64)
    where_zero = reference.nonzero_k(zero, n + 1, fill_value=n)
    stay = torch.arange(n, n + 2, device=device)  # made there: a copy from the host would wait
    nextzero = torch.cat([where_zero[before], stay])  # n and broken map to themselves
    nxt = nextzero + (1 + b)
    step = torch.where((nextzero < n) & (nxt <= n), nxt, broken)
    step[n:] = stay
    starts = torch.zeros(1, dtype=torch.int64, device=device)
    jump = step
    rounds = (count - 1).bit_length()
    for r in range(rounds):
        starts = torch.cat([starts, jump[starts]])
        if r + 1 < rounds:
            jump = jump[jump]
    starts = starts[:count]
    complete = ((starts < n) & (step[starts] <= n)).all()
    term = nextzero[starts].clamp_(max=n - 1)
    gaps = (term - starts.clamp(max=n)) << b
    if b:
        at = ((term + 1).unsqueeze(1) + torch.arange(b, device=device)).clamp_(max=n - 1)
        weights = torch.arange(b - 1, -1, -1, device=device)
        gaps = gaps + (bits[at].to(torch.int64) << weights).sum(1)
    return torch.cumsum(gaps + 1, 0) - 1, complete


def decode(data: bytes, count: int, b: int) -> np.ndarray:
    """Inverse of :func:`encode` for ``count`` positions."""
    if count == 0:
        return np.empty(0, dtype=np.int64)
    packed = np.frombuffer(data, dtype=np.uint8)
    if _walk is not None:  # straight over the packed bytes
        out, done = _walk(packed, count, b, _LEADING_ONES)
        if done != count:
            raise ValueError("Golomb-Rice stream ends early")
        return out
    bits = np.unpackbits(packed)
    # The terminating zero of codeword j is the first zero at or after its start; after it come
    # b remainder bits. Walk codewords using the list of zero positions (vectorised per word).
    zeros = np.flatnonzero(bits == 0)
    out = np.empty(count, dtype=np.int64)
    weights = (1 << np.arange(b - 1, -1, -1)).astype(np.int64) if b else None
    pos, prev, zi = 0, -1, 0
    for j in range(count):
        zi = np.searchsorted(zeros, pos, side="left") if zi >= len(zeros) or zeros[zi] < pos else zi
        if zi >= len(zeros):
            raise ValueError("Golomb-Rice stream ends early")
        z = int(zeros[zi])
        q = z - pos
        rem = int(bits[z + 1:z + 1 + b].astype(np.int64) @ weights) if b else 0
        if z + 1 + b > bits.size:
            raise ValueError("Golomb-Rice stream ends early")
        prev = prev + 1 + (q << b) + rem
        out[j] = prev
        pos = z + 1 + b
        zi += 1
    return out
