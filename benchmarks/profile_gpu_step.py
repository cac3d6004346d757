"""Where a whole training step's time goes, for one variant of ``gpu_step.py``: the variant's
and the no-exchange floor's step times measured in the same run, then rank 0's host
functions (cProfile) and its operators' host and device times (torch.profiler), with the
host reads that stall the launch queue (``aten::_local_scalar_dense``, ``cudaStreamSynchronize``,
``cudaMemcpy``) counted per step. Made because the engine's own stages explained 9 ms of a
GPU step 40 ms over its floor (``results/gpu_step_2026-11-28``).

    mpirun -np 2 python benchmarks/profile_gpu_step.py [--variant sparse_model] [--out DIR]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine  # noqa: E402
from gpu_step import build, setup, variant  # noqa: E402

import hvd_sparse.mpi as hvd  # noqa: E402

#: operators and runtime calls whose host time means the host waited for the device
STALLS = ("aten::_local_scalar_dense", "aten::item", "cudaStreamSynchronize",
          "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync", "cudaEventSynchronize")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="sparse_model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10, help="timed steps, then as many profiled")
    ap.add_argument("--out", help="folder for the JSON and the two tables (default results/)")
    args = ap.parse_args()
    dev, sync, x, y = setup(args)
    runs = {}
    for name in ("floor", args.variant):
        model = build(args.layers, args.width, dev)
        runs[name] = (model, variant(name, model))

    def step(name):
        model, opt = runs[name]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    times = {}
    for name in runs:
        for _ in range(args.warmup):
            step(name)
        sync()
        hvd.allreduce(torch.zeros(1), name=f"barrier.{name}")
        got = []
        for _ in range(args.steps):
            t = time.perf_counter()
            step(name)
            sync()
            got.append(time.perf_counter() - t)
        times[name] = max(hvd.allgather_object(statistics.median(got)))

    prof = cProfile.Profile()
    sync()
    prof.enable()
    for _ in range(args.steps):
        step(args.variant)
    sync()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)

    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as tp:
        for _ in range(args.steps):
            step(args.variant)
        sync()
    events = tp.key_averages()
    table = events.table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=60)
    stalls = {e.key: {"calls_per_step": e.count / args.steps,
                      "host_ms_per_step": e.self_cpu_time_total / 1e3 / args.steps}
              for e in events if e.key in STALLS}
    if hvd.rank() == 0:
        dest = Path(args.out) if args.out else RESULTS
        dest.mkdir(parents=True, exist_ok=True)
        tag = f"{args.variant}_{args.device}"
        out = {"machine": machine(), "ranks": hvd.size(), "args": vars(args),
               "step_s_median": times, "over_floor": times[args.variant] / times["floor"],
               "stalls_per_step": stalls}
        (dest / f"profile_gpu_step_{tag}.json").write_text(json.dumps(out, indent=1,
                                                                      default=str))
        (dest / f"profile_gpu_step_{tag}.txt").write_text(
            f"cProfile, rank 0, {args.steps} steps\n{text.getvalue()}\n"
            f"torch.profiler, rank 0, {args.steps} steps\n{table}\n")
        print(f"{args.variant}: {times[args.variant] * 1e3:.1f} ms, floor "
              f"{times['floor'] * 1e3:.1f} ms ({out['over_floor']:.2f}x); host stalls per "
              f"step: {json.dumps(stalls)}")


if __name__ == "__main__":
    main()
