"""Error-feedback memory: what was not sent this step is added to the next step's gradient.

One ``Residual`` per bucket and direction. The uplink residual is private to a rank; the downlink
residual is replicated (every rank computes it from the same gathered bytes). The update is done in
place in a single buffer so that ``sent + residual == acc`` holds exactly: the buffer first becomes
``acc``, then the selected positions keep only what the wire could not carry.
"""
from __future__ import annotations

import torch


class Residual:
    """A lazily allocated flat residual of fixed length and dtype."""

    def __init__(self, numel: int, dtype: torch.dtype):
        self.numel = numel
        self.dtype = dtype
        self.buffer: torch.Tensor | None = None

    def ensure(self, like: torch.Tensor) -> torch.Tensor:
        """The residual buffer, allocated (zeros) or moved to ``like``'s device if needed."""
        if self.buffer is None:
            self.buffer = torch.zeros(self.numel, dtype=self.dtype, device=like.device)
        elif self.buffer.device != like.device:  # restored from a checkpoint on another device
            self.buffer = self.buffer.to(like.device)
        return self.buffer

    def accumulate(self, grad: torch.Tensor) -> torch.Tensor:
        """Return ``acc = grad + residual``; the returned tensor *is* the residual buffer."""
        self.ensure(grad).add_(grad.to(self.dtype))
        return self.buffer

    def settle(self, idx: torch.Tensor, sent: torch.Tensor) -> None:
        """After ``accumulate``: positions ``idx`` were sent as ``sent``; keep only the rest."""
        if idx.numel():
            self.buffer[idx] = self.buffer[idx] - sent.to(self.dtype)

    def energy(self) -> torch.Tensor:
        """``||residual||^2`` as a 0-d tensor (no host sync): the step's compression error."""
        return torch.linalg.vector_norm(self.buffer.float()).pow(2)

    def state(self):
        return None if self.buffer is None else self.buffer.detach().clone()

    def load(self, tensor) -> None:
        if tensor is None:
            self.buffer = None
            return
        if tensor.numel() != self.numel:
            raise ValueError(f"residual has {tensor.numel()} entries, expected {self.numel}")
        self.buffer = tensor.detach().to(self.dtype).clone().reshape(-1)
