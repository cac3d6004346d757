"""Step time against the network: dense Horovod vs hvd_sparse behind a shaped link.

    .venv/bin/python benchmarks/network.py [--rates 100mbit 1gbit none] [--ranks 2 4]

Every configuration runs through ``launch/slownet.sh`` (ranks in a private network namespace,
MPI over TCP on a loopback shaped with tc) and ``python -m hvd_sparse.train --benchmark-steps``;
the floor is the same model and batch on one rank with no communication at all. Results:
benchmarks/results/network.json and network.png. Needs root (network namespaces).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import RESULTS, machine, save

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv" / "bin" / "python")

OPTIMIZERS = {
    "dense": ["--optimizer", "dense"],
    "topk": ["--optimizer", "sparse", "--sparsifier", "topk", "--density", "0.01"],
    "sbc": ["--optimizer", "sparse", "--sparsifier", "sbc", "--density", "0.01"],
    "topk_fast": ["--optimizer", "sparse", "--sparsifier", "topk", "--density", "0.01",
                  "--no-deterministic-dense"],
}


def run(cmd, timeout):
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        proc = subprocess.run(cmd + ["--metrics", f.name], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT)
        lines = Path(f.name).read_text().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rates", nargs="+", default=["100mbit", "1gbit", "none"])
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    p.add_argument("--models", nargs="+", default=["resnet", "mlp11m"])
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of other models from the existing network.json")
    args = p.parse_args()
    rows = []
    if args.merge and (RESULTS / "network.json").exists():
        old = json.loads((RESULTS / "network.json").read_text())["rows"]
        rows = [r for r in old if not (r["model"] in args.models
                                       and (r["rate"] in args.rates or r["optimizer"] == "floor"))]
    for model in args.models:
        floor = run([PY, "-m", "hvd_sparse.train", "--optimizer", "local", "--model", model,
                     "--benchmark-steps", str(args.steps)], 600)
        floor_s = floor["step_s_median"]
        rows.append({"model": model, "optimizer": "floor", "rate": "-", "ranks": 1,
                     "step_s": floor_s, "parameters": floor["parameters"]})
        print(f"{model}: floor {floor_s * 1e3:.1f} ms/step ({floor['parameters']:,} parameters)",
              flush=True)
        for rate in args.rates:
            for ranks in args.ranks:
                for name in args.optimizers:
                    cmd = [str(ROOT / "launch" / "slownet.sh"), rate, str(ranks), "--", PY, "-m",
                           "hvd_sparse.train", "--model", model, "--benchmark-steps",
                           str(args.steps), *OPTIMIZERS[name]]
                    rec = run(cmd, 900)
                    row = {"model": model, "optimizer": name, "rate": rate, "ranks": ranks,
                           "step_s": rec["step_s_median"], "step_s_all": rec["step_s_all"],
                           "parameters": rec["parameters"], "floor_s": floor_s,
                           "over_floor": rec["step_s_median"] / floor_s,
                           "bytes_sent_per_step": rec.get("bytes_sent_per_step"),
                           "dense_bytes_per_step": rec.get("dense_bytes_per_step")}
                    rows.append(row)
                    print(f"{model:7} {rate:8} np={ranks} {name:10} {row['step_s'] * 1e3:9.1f} ms"
                          f"  ({row['over_floor']:.2f}x floor)", flush=True)
    for r in rows:  # speed-up against dense in the same (model, rate, ranks)
        if r["optimizer"] not in ("floor", "dense"):
            dense = [d for d in rows if d["optimizer"] == "dense" and d["model"] == r["model"]
                     and d["rate"] == r["rate"] and d["ranks"] == r["ranks"]]
            if dense:
                r["speedup_vs_dense"] = dense[0]["step_s"] / r["step_s"]
    save("network", {"machine": machine(), "steps": args.steps, "rows": rows,
                     "note": "all ranks on one 2-core machine; the shaped loopback is shared "
                             "by every rank's traffic"})
    plot(rows, RESULTS / "network.png")


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    ranks = sorted({r["ranks"] for r in rows if r["optimizer"] != "floor"})
    fig, axes = plt.subplots(len(models), len(ranks), figsize=(5 * len(ranks), 3.5 * len(models)),
                             squeeze=False)
    for i, m in enumerate(models):
        floor = [r for r in rows if r["model"] == m and r["optimizer"] == "floor"][0]["step_s"]
        for j, n in enumerate(ranks):
            ax = axes[i][j]
            sel = [r for r in rows if r["model"] == m and r["ranks"] == n]
            rates = [r for r in dict.fromkeys(x["rate"] for x in sel)]
            opts = [o for o in dict.fromkeys(x["optimizer"] for x in sel)]
            width = 0.8 / max(1, len(opts))
            for k, o in enumerate(opts):
                vals = [next((x["step_s"] for x in sel if x["rate"] == rt and x["optimizer"] == o),
                             0) for rt in rates]
                ax.bar([q + k * width for q in range(len(rates))], vals, width, label=o)
            ax.axhline(floor, color="k", ls=":", label="floor (1 rank, no comm)")
            ax.set_yscale("log")
            ax.set_xticks([q + width for q in range(len(rates))], rates)
            ax.set_title(f"{m}, {n} ranks")
            ax.set_ylabel("s / step")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
