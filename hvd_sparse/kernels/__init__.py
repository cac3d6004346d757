"""Fused error feedback + selection, per backend.

``fused_select`` runs ``acc = grad + residual``, the selection and the residual update in one
go for the sparsifiers that have a fused form (Top-K, hard threshold) and returns ``None`` for
the others, which then take the general path. Backends: CuPy on CUDA tensors
(:mod:`.cuda`), numba on float32 CPU tensors (:mod:`.cpu`), and the plain torch reference
(:mod:`.reference`) that both are tested against and that serves every other case.
"""
from __future__ import annotations

import os

import torch

from . import cpu, cuda, reference
from ..sparsifiers.base import k_for_density
from ..sparsifiers.threshold import HardThreshold
from ..sparsifiers.topk import TopK


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


def fused_topk(grad, residual, k):
    return _IMPL[backend_for(residual)].fused_topk(grad, residual, k)


def fused_threshold(grad, residual, threshold):
    return _IMPL[backend_for(residual)].fused_threshold(grad, residual, threshold)


def fused_select(sparsifier, grad, residual, density, ctx):
    """(indices, values) with ``residual`` updated, or ``None`` if ``sparsifier`` has no fused form."""
    if type(sparsifier) is TopK:
        return fused_topk(grad, residual, k_for_density(residual.numel(), density))
    if type(sparsifier) is HardThreshold:
        return fused_threshold(grad, residual, sparsifier.threshold)
    return None
