"""Selection kernels: one set of primitives per backend, and the methods built on them.

Backends (:func:`ops_for` picks one per tensor): CuPy on float32 CUDA tensors (:mod:`.cuda`),
numba on float32 CPU tensors (:mod:`.cpu`), and plain torch for everything else
(:mod:`.reference`, also the yardstick of the fast ones). The methods (:mod:`.select`) are
called by each sparsifier's ``fused`` form. ``fused_topk`` and ``fused_threshold`` run select
and commit in one call (feedback, selection, residual update), for benchmarks and tests.
"""
from __future__ import annotations

import os

import torch

from . import cpu, cuda, reference, select
from .select import Selection

__all__ = ["ops_for", "backend_for", "fused_topk", "fused_threshold", "Selection", "select"]


def backend_for(t: torch.Tensor) -> str:
    """Which implementation serves this tensor: ``"cupy"``, ``"numba"`` or ``"torch"``.

    ``HVD_SPARSE_KERNELS=torch`` forces the reference everywhere.
    """
    if os.environ.get("HVD_SPARSE_KERNELS") == "torch" or t.dtype != torch.float32:
        return "torch"
    if t.device.type == "cuda" and cuda.available():
        return "cupy"
    if t.device.type == "cpu" and cpu.available():
        return "numba"
    return "torch"


_IMPL = {"cupy": cuda, "numba": cpu, "torch": reference}


def ops_for(t: torch.Tensor):
    """The primitives module for tensors like ``t``."""
    return _IMPL[backend_for(t)]


def _run(sel_fn, grad, residual, *args):
    ops = ops_for(residual)
    if grad is not None and grad.dtype != residual.dtype:
        ops = reference
    sel = sel_fn(ops, grad, residual, *args)
    select.commit(ops, grad, residual, sel, sel.values)
    return sel.idx, sel.values.clone()


def fused_topk(grad, residual, k):
    """``residual += grad``; the exact Top-K by magnitude (ties by lowest index) is returned and
    zeroed in the residual."""
    return _run(select.topk, grad, residual, k)


def fused_threshold(grad, residual, threshold):
    """``residual += grad``; every ``|entry| >= threshold`` is returned and zeroed."""
    return _run(select.threshold, grad, residual, threshold)
