"""Deep Gradient Compression's training aids (Lin et al., ICLR 2018), usable with any sparsifier.

* Momentum correction with factor masking: accumulate the *velocity* ``u = m * u + g`` instead
  of the raw gradient, and clear ``u`` where entries were sent, so sparse updates keep momentum's
  effect without applying stale momentum twice. Use it with a base optimizer without momentum.
* Local gradient clipping: clip each rank's gradient (per bucket) to ``clip / sqrt(P)`` before it
  enters the residual, so the sum over P ranks respects the global clip.
* Density warm-up: start near dense and shrink the density geometrically to its target.
* Density cool-down (not DGC's; the mirror of its warm-up): over the last steps of a run of known
  length, raise the density geometrically, so that the mass error feedback still holds back
  reaches the final model in small, fresh steps instead of staying in the residuals.
* Dense warm-start: exchange the first steps densely (error feedback flushed into them).
"""
from __future__ import annotations

import math

import torch


class MomentumCorrection:
    """The local velocity of one bucket."""

    def __init__(self, momentum: float):
        self.momentum = float(momentum)
        self.velocity = None

    def apply(self, grad: torch.Tensor) -> torch.Tensor:
        """Return ``u = m * u + grad`` (the tensor is the velocity buffer itself)."""
        if self.velocity is None:
            self.velocity = grad.detach().clone()
        else:
            self.velocity.mul_(self.momentum).add_(grad)
        return self.velocity

    def mask(self, idx: torch.Tensor) -> None:
        """Momentum factor masking: sent entries restart their velocity."""
        if self.velocity is not None and idx.numel():
            self.velocity[idx] = 0

    def state(self):
        return None if self.velocity is None else self.velocity.clone()

    def load(self, t):
        self.velocity = None if t is None else t.clone()


def clip_local(flat: torch.Tensor, clip_norm: float, world_size: int) -> torch.Tensor:
    """Scale ``flat`` in place to L2 norm at most ``clip_norm / sqrt(world_size)`` (no host sync)."""
    limit = clip_norm / math.sqrt(world_size)
    norm = torch.linalg.vector_norm(flat.float())
    flat.mul_(torch.clamp(limit / (norm + 1e-12), max=1.0).to(flat.dtype))
    return flat


def warmup_density(step: int, target: float, warmup_steps: int) -> float:
    """Geometric schedule from (almost) dense to ``target`` over ``warmup_steps`` steps."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return target
    return target ** ((step + 1) / (warmup_steps + 1))


def cooldown_density(step: int, target: float, final: float, total_steps,
                     cooldown_steps: int) -> float:
    """Geometric schedule from ``target`` up to ``final`` over the last ``cooldown_steps`` of a
    run of ``total_steps`` steps (``final`` from then on); ``target`` before it.

    Why: error feedback keeps what was not sent, so the returned model trails the "virtual"
    one that converges like SGD by the residuals' mass (Stich et al., NeurIPS'18; Karimireddy et
    al., ICML'19). Handing that mass over in one dense step applies stale updates at once (no gain
    measured); a density that rises over the last steps sends it gradually, each entry soon after
    it accrued, for a small share of the run's bytes."""
    if cooldown_steps <= 0 or total_steps is None:
        return target
    start = total_steps - cooldown_steps
    if step < start:
        return target
    f = min(1.0, (step - start + 1) / cooldown_steps)
    return min(1.0, target * (final / target) ** f)
