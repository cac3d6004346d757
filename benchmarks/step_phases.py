"""Where a whole training step's time goes, phase by phase, the floor's step beside the sparse one.

    .venv/bin/python benchmarks/step_phases.py [--rate 1gbit] [--ranks 2] [--model mlp11m]
        [--optimizers floor topk topk_mpi4py] [--steps 20] [--repeats 2]

`network.py` times the step and the engine's stages; what lies around them (the model's
forward and backward, the wrapped optimizer's step, ``zero_grad``, the page faults of fresh
gradients) it does not see. Here each configuration of `network.py` runs
``hvd_sparse.train --benchmark-steps`` behind `launch/slownet.sh` with this file as every
rank's entry point, which times, per step: the forward (the outermost module call), the
backward less the hooks' work, the hooks (the engine's uplink: select, encode, the start of the
collective), ``synchronize()`` (the engine's finish: wait, decode, aggregate, the downlink
selection, the write; for dense Horovod its own ``synchronize``), the wrapped optimizer's own
step and ``zero_grad``, from one ``zero_grad`` to the next; what is left is "other" (the data
batch, the loop). Minor page faults are counted per phase. Medians over the timed steps of
each rank, then over ranks and repeats (interleaved), go to
`benchmarks/results/step_phases.json` (``--name``) with a stacked-bar PNG.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("forward", "backward", "hooks", "synchronize", "optimizer_step", "zero_grad", "other")
WARMUP = 2  # untimed steps (train's own warm-up)


def _worker(out_dir: str, argv: list) -> None:
    """One rank: wrap the phases' entry points, run the training CLI, write this rank's
    per-step phase times at exit."""
    import atexit
    import runpy

    import torch

    steps = []  # one dict per step, phase -> [seconds, minor faults]
    depth = {"module": 0, "hook": 0}

    def now():
        return time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def add(phase, t0, f0):
        if steps:
            t1, f1 = now()
            cur = steps[-1].setdefault(phase, [0.0, 0])
            cur[0] += t1 - t0
            cur[1] += f1 - f0

    def timed(phase, fn, key=None):
        def wrapper(*a, **k):
            if key is not None:  # only the outermost call (modules nest; hooks in backward)
                depth[key] += 1
                if depth[key] > 1:
                    try:
                        return fn(*a, **k)
                    finally:
                        depth[key] -= 1
            t0, f0 = now()
            try:
                return fn(*a, **k)
            finally:
                add(phase, t0, f0)
                if key is not None:
                    depth[key] -= 1
        return wrapper

    zero_grad = torch.optim.Optimizer.zero_grad

    def zero_grad_step(self, *a, **k):  # a step starts at zero_grad (train's loop order)
        t0, f0 = now()
        if steps:
            steps[-1]["_end"] = t0
        steps.append({"_start": t0})
        try:
            return zero_grad(self, *a, **k)
        finally:
            add("zero_grad", t0, f0)

    backward = torch.Tensor.backward

    def backward_step(self, *a, **k):
        depth["backward"] = depth.get("backward", 0) + 1
        try:
            return backward(self, *a, **k)
        finally:
            depth["backward"] -= 1

    torch.optim.Optimizer.zero_grad = zero_grad_step
    torch.nn.Module.__call__ = timed("forward", torch.nn.Module.__call__, "module")
    torch.Tensor.backward = timed("backward", backward_step)
    for cls in (torch.optim.SGD, torch.optim.AdamW, torch.optim.Adam):
        cls.step = timed("optimizer_step", cls.step)
    try:
        from hvd_sparse.engine import pipeline

        launch = pipeline.Engine.launch
        in_hook = timed("hooks", launch, "hook")

        def launch_step(self, *a, **k):  # a bucket started by synchronize counts there
            return (in_hook if depth.get("backward") else launch)(self, *a, **k)

        pipeline.Engine.launch = launch_step
        pipeline.Engine.finish = timed("synchronize", pipeline.Engine.finish)
    except ImportError:  # pragma: no cover - the package is importable where this runs
        pass
    try:  # dense Horovod's own: its wait for the allreduces, where the engine's finish is
        from horovod.torch import optimizer as horovod_optimizer

        dense = horovod_optimizer._DistributedOptimizer
        dense.synchronize = timed("synchronize", dense.synchronize)
    except ImportError:  # no Horovod (the mpi4py front end's machines)
        pass

    def write():
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
        rows = []
        for s in steps[WARMUP:]:
            if "_end" not in s:
                continue  # the last, unfinished one
            row = {k: v for k, v in s.items() if not k.startswith("_")}
            wall = s["_end"] - s["_start"]
            # the hooks run inside backward: backward's own time is the rest
            if "backward" in row and "hooks" in row:
                row["backward"] = [row["backward"][0] - row["hooks"][0],
                                   row["backward"][1] - row["hooks"][1]]
            row["wall"] = [wall, 0]
            row["other"] = [wall - sum(row[p][0] for p in PHASES if p in row and p != "other"),
                            0]
            rows.append(row)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))

    atexit.register(write)
    sys.argv = ["hvd_sparse.train"] + argv
    runpy.run_module("hvd_sparse.train", run_name="__main__")


def _summary(rank_files) -> dict:
    """Median seconds (and faults) per phase over each rank's steps, then over the ranks."""
    per_rank = []
    for f in rank_files:
        rows = json.loads(Path(f).read_text())
        if not rows:
            continue
        keys = {k for r in rows for k in r}
        per_rank.append({k: (statistics.median(r.get(k, [0.0, 0])[0] for r in rows),
                             statistics.median(r.get(k, [0.0, 0])[1] for r in rows))
                         for k in keys})
    keys = {k for r in per_rank for k in r}
    return {"seconds": {k: statistics.median(r.get(k, (0.0, 0))[0] for r in per_rank)
                        for k in keys},
            "minor_faults": {k: statistics.median(r.get(k, (0.0, 0))[1] for r in per_rank)
                             for k in keys},
            "ranks": len(per_rank)}


def plot(rows, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(rows), 4.5))
    labels = [r["optimizer"] for r in rows]
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        vals = [max(r["seconds"].get(phase, 0.0), 0.0) * 1e3 for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=phase)
        bottom = [a + v for a, v in zip(bottom, vals)]
    ax.set_ylabel("ms per step (median)")
    first = rows[0]
    ax.set_title(f"{first['model']}, {first['ranks']} ranks, link {first['rate']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-worker":
        return _worker(sys.argv[2], sys.argv[3:])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import subprocess

    from common import PY, RESULTS, ROOT, machine, save, slownet
    from network import ENV, OPTIMIZERS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--model", default="mlp11m")
    ap.add_argument("--density", default="0.01")
    ap.add_argument("--optimizers", nargs="+", default=["floor", "topk", "topk_mpi4py"],
                    choices=sorted(OPTIMIZERS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--name", default="step_phases", help="results file stem")
    args = ap.parse_args()
    got = {name: [] for name in args.optimizers}
    for rep in range(args.repeats):
        for name in args.optimizers:
            with tempfile.TemporaryDirectory() as out:
                cmd = slownet(args.rate, args.ranks) + [
                    PY, str(Path(__file__).resolve()), "--rank-worker", out,
                    "--model", args.model, "--density", args.density,
                    "--benchmark-steps", str(args.steps), *OPTIMIZERS[name]]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                                      cwd=ROOT, env={**os.environ, **ENV.get(name, {})})
                files = sorted(Path(out).glob("rank*.json"))
                if proc.returncode != 0 or not files:
                    raise RuntimeError(f"{name} failed:\n{proc.stdout[-2000:]}\n"
                                       f"{proc.stderr[-2000:]}")
                got[name].append(_summary(files))
            s = got[name][-1]["seconds"]
            print(f"rep {rep} {name:12} wall {s['wall'] * 1e3:7.1f} ms  " + "  ".join(
                f"{p} {s.get(p, 0.0) * 1e3:.1f}" for p in PHASES), flush=True)
    rows = []
    for name, reps in got.items():
        keys = {k for r in reps for k in r["seconds"]}
        rows.append({"optimizer": name, "model": args.model, "rate": args.rate,
                     "ranks": args.ranks, "density": float(args.density),
                     "timed_steps": args.steps,
                     "seconds": {k: statistics.median(r["seconds"].get(k, 0.0) for r in reps)
                                 for k in keys},
                     "minor_faults": {k: statistics.median(r["minor_faults"].get(k, 0)
                                                           for r in reps) for k in keys},
                     "repeats": reps})
    save(args.name, {"machine": machine(), "rows": rows})
    plot(rows, RESULTS / f"{args.name}.png")


if __name__ == "__main__":
    main()
