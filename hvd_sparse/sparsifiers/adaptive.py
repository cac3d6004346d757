"""Adaptive Top-K (after Ruan et al., arXiv 2210.13532): k per step under a run-long budget.

Ruan et al. bound the convergence error of Top-K SGD by a sum over steps of per-step compression
errors, and choose k_t to minimise that bound subject to the total communication of the run. The
compression error of Top-K at step t grows with the energy of the gradient being compressed, so
the optimum spends more elements on steps whose gradients are large and fewer on quiet steps,
while the total stays within the budget.

The rule implemented here, per bucket:

* budget ``B = density * n * total_steps`` elements (``density`` is the run's average);
* the error scale of step t is predicted by ``s_t``, the squared norm of the previous step's
  aggregated sparse gradient (the sum of the ranks' payloads: the same on every rank, so every
  rank picks the same k with no extra collective; error feedback's mass is in it, so k runs
  above the even share while the residuals fill), relative to its running mean ``s_bar``;
* ``k_t = clip(round(R_t / r_t * (s_t / s_bar) ** gamma), k_min, k_max)``, with ``R_t`` the budget
  left and ``r_t`` the steps left, and never more than leaves ``k_min`` for each remaining step,
  so the total never exceeds ``B`` (after ``total_steps`` it falls back to ``k_min``).
  ``min_density`` above ``density`` is refused (the floor alone would overspend), and
  ``k_min`` is at least one entry, as every method's k is: a bucket of fewer than
  ``1 / density`` entries sends one per step, more than its share.

Without ``total_steps`` (a run of unknown length) the budget accrues at ``density * n`` per step
and is planned over a rolling horizon of ``horizon`` steps: the same rule with ``R_t`` the budget
accrued so far plus the horizon's, and ``r_t = horizon``, so the long-run average stays
``density``.

``gamma`` sets how strongly k follows the error (0 gives an even spread, i.e. plain Top-K).

Under a density warm-up or cool-down (the engine's schedules) a scheduled step takes the
schedule's k and is charged to the budget at the configured density only: charged in full, a
47-step warm-up at 1% spent 90% of a 1,000-step run's budget and left the rest at ``k_min``.
"""
from __future__ import annotations

import math
import sys
import weakref

import torch

from ..kernels import select as fused_select
from ..kernels.sums import fixed_point_sum
from .. import validate
from .base import Sparsifier, k_for_density, topk_indices


_last_square_sum = (None, -1, 0.0)  # (weak reference to the tensor, its version, the sum)


def square_sum(values: torch.Tensor) -> float:
    """``sum(values ** 2)``, the same bits on every rank whatever the device or thread count
    (every rank must choose the same k from it; see :mod:`~hvd_sparse.kernels.sums`). The
    uplink's and the downlink's method observe the same tensor: the last result is kept for as
    long as that tensor lives unchanged."""
    global _last_square_sum
    ref, version, total = _last_square_sum
    if ref is not None and ref() is values and values._version == version:
        return total
    total = fixed_point_sum(values, square=True)
    _last_square_sum = (weakref.ref(values), values._version, total)
    return total


class AdaptiveTopK(Sparsifier):
    name = "adaptive"

    def __init__(self, total_steps: int = None, min_density: float = None,
                 max_density: float = None, gamma: float = 1.0, ema: float = 0.9,
                 horizon: int = 100):
        if total_steps is not None and (isinstance(total_steps, bool) or
                                        not isinstance(total_steps, int) or total_steps <= 0):
            raise ValueError(f"adaptive Top-K takes total_steps > 0 (the run's length over "
                             f"which the budget is spent) or None, got {total_steps!r}")
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon <= 0:
            raise ValueError(f"horizon must be a positive int, got {horizon!r}")
        self.total_steps = total_steps
        self.horizon = horizon
        self.min_density = None if min_density is None else validate.real(
            "min_density", min_density, 0, 1)
        self.max_density = None if max_density is None else validate.real(
            "max_density", max_density, 0, 1, lo_open=True)
        if None not in (self.min_density, self.max_density) \
                and self.min_density > self.max_density:
            raise ValueError(f"adaptive Top-K needs min_density <= max_density, got "
                             f"{min_density!r} > {max_density!r}")
        self.gamma = validate.real("gamma", gamma, 0)
        self.ema = validate.real("ema", ema, 0, 1, hi_open=True)
        self.buckets = {}  # bucket -> {"spent", "steps", "signal", "mean", "last_k"}

    @staticmethod
    def density_for_budget(total_bytes: float, total_steps: int, model_numel: int,
                           bytes_per_entry: int = 8) -> float:
        """The average density that spends ``total_bytes`` per rank over ``total_steps``."""
        return total_bytes / (total_steps * model_numel * bytes_per_entry)

    _FRESH = {"spent": 0, "steps": 0, "signal": None, "mean": None, "last_k": 0}

    def _state(self, bucket):
        return self.buckets.setdefault(bucket, dict(self._FRESH))

    @staticmethod
    def _scheduled(density, ctx) -> bool:
        """A warm-up's or a cool-down's step: its density is the schedule's, not the plan's."""
        return ctx is not None and ctx.base_density is not None and density != ctx.base_density

    def k_for_step(self, numel: int, density: float, bucket: str, ctx=None) -> int:
        if self._scheduled(density, ctx):
            return k_for_density(numel, density)
        st = self.buckets.get(bucket) or self._FRESH  # read only
        lo_d = self.min_density if self.min_density is not None else density / 10
        hi_d = self.max_density if self.max_density is not None else min(1.0, density * 10)
        if not lo_d <= density <= hi_d:  # the floor alone would overspend the budget
            raise ValueError(f"adaptive Top-K needs min_density <= density <= max_density, got "
                             f"{lo_d!r}, {density!r}, {hi_d!r}")
        k_min, k_max = k_for_density(numel, lo_d), k_for_density(numel, hi_d)
        if self.total_steps is None:  # rolling horizon: the budget accrues step by step
            left_steps = self.horizon
            left = density * numel * (st["steps"] + self.horizon) - st["spent"]
        else:
            left_steps = self.total_steps - st["steps"]
            if left_steps <= 0:
                return k_min
            left = density * numel * self.total_steps - st["spent"]
        ratio = 1.0
        if st["signal"] is not None and st["mean"]:
            ratio = (st["signal"] / st["mean"]) ** self.gamma
            if math.isnan(ratio):  # (inf / inf: a state saved before the signal was capped)
                ratio = 1.0
        want = left / left_steps * ratio  # (a huge signal over a small mean: inf, the most)
        k = round(want) if math.isfinite(want) else numel
        cap = math.floor(left - k_min * (left_steps - 1))
        return max(min(k, k_max, cap, numel), min(k_min, numel), 0)

    def _take(self, bucket, k, numel=None, density=None, ctx=None):
        st = self._state(bucket)
        # a scheduled step costs the budget its share at the configured density
        st["spent"] += k_for_density(numel, ctx.base_density) \
            if self._scheduled(density, ctx) else k
        st["steps"] += 1
        st["last_k"] = k

    def select(self, acc, density, ctx):
        k = self.k_for_step(acc.numel(), density, ctx.bucket, ctx)
        self._take(ctx.bucket, k, acc.numel(), density, ctx)
        return topk_indices(acc, k)

    def fused(self, ops, grad, residual, density, ctx):
        k = self.k_for_step(residual.numel(), density, ctx.bucket, ctx)
        sel = fused_select.topk(ops, grad, residual, k, watch=ctx.watch)
        if not sel.nonfinite:  # a step with NaN/Inf selects nothing and spends nothing
            self._take(ctx.bucket, k, residual.numel(), density, ctx)
        return sel

    def target_count(self, numel, density, ctx):
        # the k this step would take (read-only): a dense step must not freeze the choice
        return self.k_for_step(numel, density, ctx.bucket, ctx)

    observes = True

    def observe(self, aggregate, ctx):
        st = self._state(ctx.bucket)
        # (a float64 aggregate's squares overflow past 1e154: the largest float stands in, so
        # that the ratio below stays a number)
        s = min(square_sum(aggregate), sys.float_info.max)
        st["signal"] = s
        st["mean"] = s if st["mean"] is None else self.ema * st["mean"] + (1 - self.ema) * s

    def state_dict(self):
        return {"buckets": {b: dict(v) for b, v in self.buckets.items()}}

    def load_state_dict(self, state):
        self.buckets = {b: dict(v) for b, v in state.get("buckets", {}).items()}

    def __repr__(self):
        return (f"AdaptiveTopK(total_steps={self.total_steps}, horizon={self.horizon}, "
                f"gamma={self.gamma}, "
                f"min_density={self.min_density}, max_density={self.max_density})")
