"""Per-step and cumulative communication accounting for one rank."""
from __future__ import annotations

from typing import Dict


class CommunicationStats:
    """Bytes this rank put on and took off the wire, against what dense allreduce would cost.

    ``dense_bytes`` is the size of the gradients synchronised in the step (what a dense allreduce
    carries per rank before the ring factor 2(P-1)/P); ``bytes_sent`` / ``bytes_received`` count
    payload bytes exactly, headers and padding included, and dense-path tensors at their size.
    """

    KEYS = ("bytes_sent", "bytes_received", "dense_bytes", "selected", "numel")

    def __init__(self):
        self.steps = 0
        self.totals = {k: 0 for k in self.KEYS}
        self.last: Dict[str, int] = {k: 0 for k in self.KEYS}
        self.last_selected_per_bucket: Dict[str, int] = {}
        self._current: Dict[str, int] = {k: 0 for k in self.KEYS}
        self._current_per_bucket: Dict[str, int] = {}

    def record(self, bucket: str, *, sent: int, received: int, dense: int, selected: int,
               numel: int) -> None:
        c = self._current
        c["bytes_sent"] += sent
        c["bytes_received"] += received
        c["dense_bytes"] += dense
        c["selected"] += selected
        c["numel"] += numel
        self._current_per_bucket[bucket] = selected

    def end_step(self) -> None:
        self.last = dict(self._current)
        self.last_selected_per_bucket = dict(self._current_per_bucket)
        for k in self.KEYS:
            self.totals[k] += self._current[k]
        self.steps += 1
        self._current = {k: 0 for k in self.KEYS}
        self._current_per_bucket = {}

    def as_dict(self) -> dict:
        out = dict(self.last)
        out["density"] = self.last["selected"] / self.last["numel"] if self.last["numel"] else 0.0
        out["selected_per_bucket"] = dict(self.last_selected_per_bucket)
        out["steps"] = self.steps
        out["totals"] = dict(self.totals)
        sent = self.totals["bytes_sent"]
        out["totals"]["compression_ratio"] = self.totals["dense_bytes"] / sent if sent else 0.0
        return out

    def state_dict(self) -> dict:
        return {"steps": self.steps, "totals": dict(self.totals)}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state.get("steps", 0))
        self.totals.update(state.get("totals", {}))
