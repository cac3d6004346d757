"""Shared helpers for the benchmarks: timing, machine description, JSON and plots."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    """What the numbers were measured on."""
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        info["cpu"] = next(l.split(":", 1)[1].strip() for l in lines if l.startswith("model name"))
        mhz = [l.split(":", 1)[1].strip() for l in lines if l.startswith("cpu MHz")]
        if mhz:
            info["cpu_mhz"] = float(mhz[0])
    except (OSError, StopIteration):
        pass
    # machines that print the same CPU name have differed 2-3x in speed here: the date tells
    # which session's machine a figure came from
    info["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def timeit(fn, repeat=5, warmup=1, sync=None) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if sync:
            sync()
        t = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv" / "bin" / "python")


def slownet(rate: str, ranks: int) -> list:
    """The launcher prefix that runs a command's ranks behind a shaped link of ``rate``."""
    return [str(ROOT / "launch" / "slownet.sh"), rate, str(ranks), "--"]


def train_run(name: str, train_args, launcher=(), timeout: int = 3600) -> list:
    """Run ``python -m hvd_sparse.train TRAIN_ARGS`` (under ``launcher``, e.g.
    :func:`slownet`) and return rank 0's per-epoch records; the run's output on failure."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        cmd = [*launcher, PY, "-m", "hvd_sparse.train", "--no-progress", "--metrics", f.name,
               *train_args]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        return [json.loads(line) for line in Path(f.name).read_text().splitlines()]


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path


def stacked_stages(ax, labels, stage_dicts):
    """One stacked bar per label: milliseconds per pipeline stage (hvd_sparse.engine.stages)."""
    from hvd_sparse.engine.stages import STAGES

    bottom = [0.0] * len(labels)
    for st in STAGES:
        vals = [d.get(st, 0.0) * 1e3 for d in stage_dicts]
        if any(vals):
            ax.bar(labels, vals, bottom=bottom, label=st)
            bottom = [a + v for a, v in zip(bottom, vals)]
