"""Per-step and cumulative communication accounting for one rank."""
from __future__ import annotations

from typing import Dict, Optional

import torch


class CommunicationStats:
    """Bytes this rank put on and took off the wire, against what dense allreduce would cost.

    ``dense_bytes`` is the size of the gradients synchronised in the step (what a dense allreduce
    carries per rank before the ring factor 2(P-1)/P); ``bytes_sent`` / ``bytes_received`` count
    payload bytes exactly, headers and padding included, and dense-path tensors at their size.
    ``selected`` is this rank's uplink count and ``target`` what the sparsifier aimed at;
    ``compression_error`` is ``sum ||acc - sent||^2`` over buckets (its running sum in ``totals``
    is the *total error* of Sahu et al.); ``bits_per_selected`` is wire bits per sent entry.
    ``totals["calibration_bytes"]``: what the time cost model's link probes sent (apart from
    ``bytes_sent``, which counts the steps' exchanges).
    """

    KEYS = ("bytes_sent", "bytes_received", "dense_bytes", "selected", "numel", "target",
            "downlink_selected")

    def __init__(self):
        self.steps = 0
        self.skipped = 0  # steps skipped on every rank for a non-finite gradient
        self.nonfinite_steps = 0  # steps where some rank's gradient held NaN/Inf
        self.totals = {k: 0 for k in self.KEYS}
        self.totals["compression_error"] = 0.0
        self.totals["calibration_bytes"] = 0  # the time cost model's link probes, sent
        self.last: Dict[str, float] = {k: 0 for k in self.KEYS}
        self.last["compression_error"] = 0.0
        self.last_per_bucket: Dict[str, dict] = {}
        self._reset_current()

    def _reset_current(self):
        self._current = {k: 0 for k in self.KEYS}
        self._errors = []
        self._current_per_bucket = {}

    def record(self, bucket: str, *, sent: int, received: int, dense: int, selected: int,
               numel: int, target: Optional[int] = None, error: Optional[torch.Tensor] = None,
               downlink_selected: Optional[int] = None) -> None:
        c = self._current
        c["bytes_sent"] += sent
        c["bytes_received"] += received
        c["dense_bytes"] += dense
        c["selected"] += selected
        c["numel"] += numel
        c["target"] += selected if target is None else target
        c["downlink_selected"] += selected if downlink_selected is None else downlink_selected
        if error is not None:
            self._errors.append(error)
        self._current_per_bucket[bucket] = {"selected": selected, "target": target,
                                            "bytes_sent": sent}

    def end_step(self) -> None:
        self.last = dict(self._current)
        # one host read per step and device, for all buckets together (a GPU model's
        # errors come from the device's residuals, or as CPU numbers where the scan measured
        # them: a half-precision bucket beside float32 ones, a method's plain path)
        by_device = {}
        for e in self._errors:
            by_device.setdefault(e.device, []).append(e.double())
        self.last["compression_error"] = float(sum(float(torch.stack(es).sum())
                                                   for es in by_device.values()))
        self.last_per_bucket = dict(self._current_per_bucket)
        for k in self.KEYS:
            self.totals[k] += self._current[k]
        self.totals["compression_error"] += self.last["compression_error"]
        self.steps += 1
        self._reset_current()

    def as_dict(self) -> dict:
        out = dict(self.last)
        out["density"] = self.last["selected"] / self.last["numel"] if self.last["numel"] else 0.0
        out["bits_per_selected"] = (8 * self.last["bytes_sent"] / self.last["selected"]
                                    if self.last["selected"] else 0.0)
        out["selected_per_bucket"] = {b: v["selected"] for b, v in self.last_per_bucket.items()}
        out["target_per_bucket"] = {b: v["target"] for b, v in self.last_per_bucket.items()}
        out["steps"] = self.steps
        out["skipped_steps"] = self.skipped
        out["nonfinite_steps"] = self.nonfinite_steps
        out["totals"] = dict(self.totals)
        sent = self.totals["bytes_sent"]
        out["totals"]["compression_ratio"] = self.totals["dense_bytes"] / sent if sent else 0.0
        return out

    def state_dict(self) -> dict:
        return {"steps": self.steps, "skipped": self.skipped,
                "nonfinite": self.nonfinite_steps, "totals": dict(self.totals)}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state.get("steps", 0))
        self.skipped = int(state.get("skipped", 0))
        self.nonfinite_steps = int(state.get("nonfinite", 0))
        self.totals.update(state.get("totals", {}))
