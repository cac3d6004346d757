"""Horovod's background cycle against the sparse step, behind a 1 Gbit/s link.

    .venv/bin/python benchmarks/cycle_time.py [--cycles 1 2 5] [--repeats 3] [--import DIR]

Horovod starts a collective only at its next background cycle (``HOROVOD_CYCLE_TIME``; the
training CLI sets 5 ms, Horovod's own default is 1 ms), so the last bucket's allgather, sent
after backward, waits for a cycle. This times the mlp11m step (Top-K 1%, exchanged gradients,
``--ranks`` ranks, 2 by default, behind ``launch/slownet.sh 1gbit``) at each cycle, interleaved with the no-exchange floor,
``--repeats`` times. ``--import DIR`` reads ``DIR/m_<floor|cN>_<rep>.jsonl`` from runs already
made. Writes ``benchmarks/results/cycle_time.json`` (``cycle_time_<N>ranks.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import PY, ROOT, machine, save, slownet

STEP = ["-m", "hvd_sparse.train", "--model", "mlp11m", "--density", "0.01",
        "--benchmark-steps", "20"]
SPARSE = ["--optimizer", "sparse", "--exchange", "gradient", "--sparsifier", "topk"]


def run(cfg: str, cycle: float, ranks: int) -> list:
    args = ["--optimizer", "local"] if cfg == "floor" else SPARSE
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        subprocess.run([*slownet("1gbit", ranks), PY, *STEP, *args, "--metrics", f.name],
                       check=True, capture_output=True, cwd=ROOT,
                       env={**os.environ, "HOROVOD_CYCLE_TIME": f"{cycle:g}"})
        return [json.loads(line) for line in Path(f.name).read_text().splitlines()]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cycles", nargs="+", type=float, default=[1, 2, 5])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--import", dest="imported", default=None)
    args = p.parse_args()
    configs = ["floor"] + [f"c{c:g}" for c in args.cycles]
    got = {c: [] for c in configs}
    for rep in range(1, args.repeats + 1):
        for cfg in configs:
            if args.imported:
                path = Path(args.imported) / f"m_{cfg}_{rep}.jsonl"
                recs = [json.loads(line) for line in path.read_text().splitlines()]
            else:
                recs = run(cfg, 5.0 if cfg == "floor" else float(cfg[1:]), args.ranks)
            step = statistics.median(r["step_s_median"] for r in recs)  # floor: one per rank
            got[cfg].append({"step_s": step, "stage_s_mean": recs[-1].get("stage_s_mean")})
            print(f"{cfg:6} rep {rep} {step * 1e3:7.1f} ms", flush=True)
    floor = statistics.median(r["step_s"] for r in got["floor"])
    rows = [{"config": cfg, "cycle_ms": None if cfg == "floor" else float(cfg[1:]),
             "step_s": statistics.median(r["step_s"] for r in runs),
             "over_floor": statistics.median(r["step_s"] for r in runs) / floor,
             "repeats": runs} for cfg, runs in got.items()]
    name = "cycle_time" if args.ranks == 2 else f"cycle_time_{args.ranks}ranks"
    save(name, {"machine": machine(), "ranks": args.ranks, "rows": rows,
                "note": f"mlp11m, Top-K 1%, exchanged gradients, {args.ranks} ranks behind "
                        f"launch/slownet.sh 1gbit {args.ranks}; medians over interleaved "
                        "repeats"})
    for r in rows:
        print(f"{r['config']:6} {r['step_s'] * 1e3:7.1f} ms  {r['over_floor']:.2f}x the floor")


if __name__ == "__main__":
    main()
