"""Where a step's time goes: wall-clock seconds per stage of the sparse pipeline.

The stages, in data-flow order: ``uplink_select`` (scan and gather of acc = grad + residual),
``encode``, ``collective_wait``, ``decode``, ``uplink_commit`` (residual write), ``aggregate``
(payloads scattered into the downlink residual), ``downlink_select`` and ``write`` (``p.grad``).
``dense`` is time spent on buckets that went dense. Reading the clock costs well under a
microsecond, a few calls per bucket.
"""
from __future__ import annotations

import time

STAGES = ("uplink_select", "encode", "collective_wait", "decode", "uplink_commit", "aggregate",
          "downlink_select", "write", "dense")


#: stages that are this rank's own work on a sparse bucket (what the cost model weighs)
COMPUTE = ("uplink_select", "encode", "decode", "uplink_commit", "aggregate", "downlink_select",
           "write")


class StageClock:
    """Seconds per stage for the current step, the last one and the run; and, per bucket, this
    step's sparse-path compute (the cost model's input)."""

    def __init__(self):
        self.current = dict.fromkeys(STAGES, 0.0)
        self.last = dict(self.current)
        self.totals = dict(self.current)
        self.bucket_compute = {}

    def stage(self, name, bucket=None) -> "_Timed":
        """``with clock.stage(name, bucket):`` adds the block's wall time to the stage (a plain
        class, not a generator-based context manager: a few of these run per bucket and step,
        and the generator form cost about 2 us each)."""
        return _Timed(self, name, bucket)

    def add(self, name, bucket, dt) -> None:
        self.current[name] += dt
        if bucket is not None and name in COMPUTE:
            self.bucket_compute[bucket] = self.bucket_compute.get(bucket, 0.0) + dt

    def end_step(self):
        self.last = self.current
        for k, v in self.current.items():
            self.totals[k] += v
        self.current = dict.fromkeys(STAGES, 0.0)
        self.bucket_compute = {}


class _Timed:
    __slots__ = ("clock", "name", "bucket", "t")

    def __init__(self, clock, name, bucket):
        self.clock, self.name, self.bucket = clock, name, bucket

    def __enter__(self):
        self.t = time.perf_counter()

    def __exit__(self, *exc):
        self.clock.add(self.name, self.bucket, time.perf_counter() - self.t)
        return False
