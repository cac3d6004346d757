"""Deterministic grouping of parameters into flat buckets.

A bucket is the unit of selection and communication: its gradients are flattened into one vector,
Top-K (or another sparsifier) runs over that vector, and one payload is sent for it. Buckets are
formed from parameter names and the optimizer's parameter order only, so every rank builds the
same buckets with no collective.

Scopes:
  * ``"tensor"``: one selection per parameter (layer-wise); each its own bucket, except that
    short tensors on the CPU share buckets (:func:`_pack_layerwise`);
  * ``"model"``: one bucket per dtype/device holding every parameter (global selection);
  * ``"bucket"``: parameters in reverse order (the order backward produces them) packed into
    buckets of at most ``bucket_cap_mb``.
Horovod's ``groups`` (a list of parameter lists, or a number of groups) defines buckets directly.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from . import wire

SCOPES = ("tensor", "model", "bucket")  # and "auto": see resolve_scope


@dataclass
class Bucket:
    index: int
    name: str
    params: List[torch.nn.Parameter]
    names: List[str]
    dtype: torch.dtype
    sparse: bool
    numel: int = 0
    offsets: List[int] = field(default_factory=list)
    tag: int = 0
    index_dtype: torch.dtype = torch.int32
    #: (lo, hi) of each parameter's flattened entries held here; the whole tensor unless a
    #: parameter larger than ``max_bucket_numel`` was split across buckets
    slices: List[Tuple[int, int]] = None
    #: several tensors, each selected by itself (scope "tensor": a layer floor of 1)
    layerwise: bool = False
    #: every parameter held whole (no slice of a split one): whole-gradient copies apply
    whole: bool = True

    def __post_init__(self):
        if self.slices is None:
            self.slices = [(0, p.numel()) for p in self.params]
        off = 0
        self.offsets = []
        for lo, hi in self.slices:
            self.offsets.append(off)
            off += hi - lo
        self.numel = off
        self.whole = all(lo == 0 and hi == p.numel() for p, (lo, hi) in zip(self.params,
                                                                           self.slices))
        self.tag = wire.fingerprint(self.name, self.numel)
        self.index_dtype = wire.index_dtype_for(self.numel)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def segments(self) -> Tuple[Tuple[int, int], ...]:
        """Each parameter's (start, end) within the bucket's flat entries."""
        return tuple((off, off + hi - lo) for off, (lo, hi) in zip(self.offsets, self.slices))


def _split_list(items: list, n: int) -> List[list]:
    """Split into n contiguous, near-equal chunks (Horovod's rule for ``groups=int``)."""
    d, r = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + d + (1 if i < r else 0)
        if end > start:
            out.append(items[start:end])
        start = end
    return out


def _bucket_name(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}+{len(names) - 1}more"


def _split(chunk, max_numel):
    """Cut a chunk of (name, param) into pieces of at most ``max_numel`` entries; a parameter
    may be cut, its pieces named ``name[lo:hi]``. Yields lists of (name, param, lo, hi)."""
    piece, room = [], max_numel
    for n, p in chunk:
        lo, total = 0, p.numel()
        while lo < total:
            take = min(room, total - lo)
            piece.append((n, p, lo, lo + take))
            lo += take
            room -= take
            if room == 0:
                yield piece
                piece, room = [], max_numel
    if piece:
        yield piece


def _pack_small(params, min_sparse_numel):
    """The tensors too small to sparsify travel together, one dense bucket per dtype and
    device: one launch and one allreduce instead of one per bias or norm weight (the
    per-bucket Python costs more than their bytes); first in the list, so launched last, when
    backward has reached the first layers' biases anyway. Under every scope: in a bucket with
    large tensors a norm weight would get a few entries a step (with a layer floor) or wait
    its turn (without), where it costs next to nothing dense. Returns (packed chunks, the
    other tensors)."""
    small = {}
    for n, p in params:
        if p.numel() < min_sparse_numel:
            small.setdefault((p.dtype, p.device), []).append((n, p))
    return list(small.values()), [(n, p) for n, p in params if p.numel() >= min_sparse_numel]


#: under scope "tensor", tensors on the CPU shorter than this share buckets ...
PACK_BELOW = 1 << 17
#: ... of at most this many entries
PACK_NUMEL = 1 << 20


def pack_below() -> int:
    """:data:`PACK_BELOW`, or ``HVD_SPARSE_PACK_BELOW`` (entries; 0: one bucket per tensor,
    for comparisons). Must be the same on every rank (the buckets are compared)."""
    value = os.environ.get("HVD_SPARSE_PACK_BELOW")
    if value is None:
        return PACK_BELOW
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"HVD_SPARSE_PACK_BELOW must be a whole number of entries (0: one "
                         f"bucket per tensor), got {value!r}") from None


def _pack_layerwise(params, below, cap, alone=None):
    """Runs of consecutive float32 CPU tensors shorter than ``below`` entries, each run cut
    into buckets of at most ``cap`` entries; every other tensor alone. Why: each bucket costs
    the engine about 0.3 ms of Python per step on the CPU whatever its length, more than
    selecting from 100,000 entries; a shared bucket keeps one Top-K per tensor (a layer
    floor of 1, ranked in one numba call) and so the same selection. ``alone(numel)``: a
    tensor it answers True for keeps a bucket of its own. Returns chunks of (name, param),
    and which of them are shared."""
    chunks, shared, run, size = [], set(), [], 0

    def close():
        nonlocal run, size
        if run:
            chunks.append(run)
            if len(run) > 1:
                shared.add(id(run))
        run, size = [], 0

    for n, p in params:
        short = p.numel() < below and p.dtype == torch.float32 and p.device.type == "cpu" \
            and not (alone is not None and alone(p.numel()))
        if not short:
            close()
            chunks.append([(n, p)])
            continue
        if run and size + p.numel() > cap:
            close()
        run.append((n, p))
        size += p.numel()
    close()
    return chunks, shared


def _scope_chunks(params, scope, bucket_cap_mb):
    """The sparse tensors grouped by ``scope``."""
    if scope == "tensor":
        return [[(n, p)] for n, p in params]
    if scope == "model":
        keyed = {}
        for n, p in params:
            keyed.setdefault((str(p.dtype), str(p.device)), []).append((n, p))
        return list(keyed.values())
    chunks, current, size = [], [], 0
    cap = bucket_cap_mb * 2**20
    for n, p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap or p.dtype != current[0][1].dtype):
            chunks.append(current)
            current, size = [], 0
        current.append((n, p))
        size += nbytes
    if current:
        chunks.append(current)
    return chunks


# below this uplink density the default scope is one Top-K over the whole model
GLOBAL_TOPK_BELOW = 0.01


def resolve_scope(scope: str, density, sparsifier) -> str:
    """``scope="auto"`` (the default): one Top-K over the whole model (``"model"``) below 1%
    density, one per tensor (``"tensor"``) from there up and for other sparsifiers.

    Why: below 1% a layer-wise selection leaves each tensor a thousandth of its entries or
    fewer, and one global selection (Shi et al., 2019) ended better on every model measured
    at 0.1% (docs/results.md "Convergence", twenty-third session): with the library's defaults the
    char-LSTM +14.3% against +17.8% and the Transformer +6.4% against +7.4% (300 steps); with
    the training CLI's, the char-LSTM +4.1 / +3.8% against +5.3%, the held-out GRU
    +5.1 / +5.1 / +5.6% against +6.3%, the held-out TCN +1.5 / +1.6% against +8.9%, the
    Transformer +3.3 / +3.3% against +4.5 / +4.3%, the ResNet 88.59% against 88.42% (dense
    89.44%). At 1% it cost the ResNet (88.09% against 89.22%). Other sparsifiers keep their
    per-layer statistics (SBC's means, GaussianK's fit, a threshold's scale), where no study
    was made."""
    if scope != "auto":
        return scope
    low = isinstance(density, (int, float)) and not isinstance(density, bool) \
        and density < GLOBAL_TOPK_BELOW
    return "model" if low and _is_topk(sparsifier) else "tensor"


def _is_topk(sparsifier) -> bool:
    """Top-K by name (any case) or by instance: ``TopK()`` chooses like ``"topk"``."""
    from .sparsifiers import TopK

    if isinstance(sparsifier, str):
        from .sparsifiers import canonical

        return canonical(sparsifier) == "topk"
    return isinstance(sparsifier, TopK)


def plan_buckets(params: Sequence[Tuple[str, torch.nn.Parameter]], *, scope: str = "tensor",
                 bucket_cap_mb: float = 25.0, groups=None, min_sparse_numel: int = 1024,
                 max_bucket_numel: Optional[int] = None, pack: int = 0,
                 alone=None) -> List[Bucket]:
    """Group ``(name, parameter)`` pairs (in optimizer order) into buckets.

    ``pack`` (entries; scope "tensor" only, for a method that selects per tensor inside a
    bucket): the tensors below it share layer-wise buckets (:func:`_pack_layerwise`), but
    those ``alone(numel)`` keeps apart.

    Tensors below ``min_sparse_numel`` entries are packed into one dense bucket per dtype and
    device (Horovod's ``groups`` excepted: there a group below it goes dense as a whole);
    buckets above ``max_bucket_numel`` entries are split (a large parameter across several
    buckets). The size rule is the whole chunk's, not a piece's: pieces cut from a large
    tensor stay sparse however short ``max_bucket_numel`` makes them (a cap below
    ``min_sparse_numel`` sent every piece dense, compression silently off).
    """
    if scope not in SCOPES:
        raise ValueError(f"scope={scope!r} is not one of {('auto',) + SCOPES}")
    params = list(params)
    name_of = {id(p): n for n, p in params}
    chunks: List[List[Tuple[str, torch.nn.Parameter]]] = []
    packed = set()  # ids of chunks of small tensors: dense whatever their total size
    layerwise = set()  # ids of chunks of sparse tensors each selected by itself

    if groups is not None:
        if isinstance(groups, int):
            chunks = [list(c) for c in _split_list(params, groups)]
        else:
            grouped = set()
            by_id = {id(p): (n, p) for n, p in params}
            for g in groups:
                chunk = [by_id[id(p)] for p in g if id(p) in by_id]
                grouped.update(id(p) for p in g)
                if chunk:
                    chunks.append(chunk)
            chunks += [[(n, p)] for n, p in params if id(p) not in grouped]
    else:
        chunks, params = _pack_small(params, min_sparse_numel)
        packed.update(id(c) for c in chunks)
        if scope == "tensor" and pack > 0:
            cap = PACK_NUMEL if max_bucket_numel is None else min(PACK_NUMEL, max_bucket_numel)
            # only tensors that fit a shared bucket whole (at most cap entries) share one, so
            # no shared bucket is ever cut by max_bucket_numel
            more, layerwise = _pack_layerwise(params, min(pack, cap + 1), cap, alone)
            chunks += more
        else:
            chunks += _scope_chunks(params, scope, bucket_cap_mb)

    buckets = []
    for chunk in chunks:
        dtypes = {p.dtype for _, p in chunk}
        if len(dtypes) > 1:
            raise ValueError(f"a group mixes dtypes {sorted(map(str, dtypes))}: "
                             f"{[n for n, _ in chunk]}; put parameters of one dtype in a group")
        numel = sum(p.numel() for _, p in chunk)
        if max_bucket_numel and numel > max_bucket_numel:
            pieces = list(_split(chunk, max_bucket_numel))
        else:
            pieces = [[(n, p, 0, p.numel()) for n, p in chunk]]
        dense = id(chunk) in packed
        for piece in pieces:
            names = [n for n, *_ in piece]
            label = [n if (lo, hi) == (0, p.numel()) else f"{n}[{lo}:{hi}]"
                     for n, p, lo, hi in piece]
            buckets.append(Bucket(index=len(buckets), name=_bucket_name(label),
                                  params=[p for _, p, *_ in piece], names=names,
                                  dtype=piece[0][1].dtype,
                                  sparse=not dense and numel >= min_sparse_numel,
                                  slices=[(lo, hi) for *_, lo, hi in piece],
                                  layerwise=id(chunk) in layerwise))
    seen = {}
    for b in buckets:
        if b.name in seen:
            raise ValueError(f"two buckets are both named {b.name!r}")
        seen[b.name] = b
    del name_of
    return buckets
