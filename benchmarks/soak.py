"""Soak: 4 ranks, 10,000 steps, variable-k sparsifier (GaussianK), bidirectional, replica
checks on; reports identical replicas and resident memory over the run.

    .venv/bin/python benchmarks/soak.py [--ranks 4] [--steps 10000]

Results: benchmarks/results/soak.json (RSS per rank every 1,000 steps, final checksums, time).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine, save

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import hashlib, json, sys, time, psutil, torch, torch.nn.functional as F
import hvd_sparse as hvd
torch.set_num_threads(1)
hvd.init()
steps, every = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=m.named_parameters(), sparsifier="gaussiank",
                               density=0.01, bidirectional=True, verify_every=every,
                               min_sparse_numel=0, cost_model="off")
proc, rss, counts, t0 = psutil.Process(), [], [], time.time()
for i in range(steps):
    g = torch.Generator().manual_seed(i * 7 + hvd.rank())
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    opt.zero_grad()
    F.cross_entropy(m(x), y).backward()
    opt.step()
    counts.append(opt.communication_stats()["selected"])
    if (i + 1) % 1000 == 0:
        rss.append([i + 1, proc.memory_info().rss])
digest = hashlib.sha256(torch.cat([p.detach().reshape(-1) for p in m.parameters()]).numpy().tobytes()).hexdigest()
down = hashlib.sha256(torch.cat([v.downlink for v in opt.engine_state().values() if v.sparse]).numpy().tobytes()).hexdigest()
out = {"rank": hvd.rank(), "rss": rss, "params_sha256": digest, "downlink_sha256": down,
       "seconds": time.time() - t0, "selected_min": min(counts), "selected_max": max(counts),
       "steps": opt.communication_stats()["steps"]}
print("SOAK " + json.dumps(out), flush=True)
"""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--verify-every", type=int, default=500)
    args = p.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(WORKER)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(args.ranks),
           str(ROOT / ".venv" / "bin" / "python"), f.name, str(args.steps), str(args.verify_every)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=7200)
    os.unlink(f.name)
    ranks = [json.loads(l.split("SOAK ", 1)[1]) for l in proc.stdout.splitlines() if "SOAK " in l]
    if proc.returncode != 0 or len(ranks) != args.ranks:
        sys.exit(f"soak failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    ranks.sort(key=lambda r: r["rank"])
    identical = len({r["params_sha256"] for r in ranks}) == 1 and \
        len({r["downlink_sha256"] for r in ranks}) == 1
    growth = [r["rss"][-1][1] - r["rss"][0][1] for r in ranks]
    summary = {"ranks": args.ranks, "steps": args.steps, "verify_every": args.verify_every,
               "identical_replicas": identical, "rss_growth_bytes_1k_to_end": growth,
               "seconds": max(r["seconds"] for r in ranks),
               "selected_range": [min(r["selected_min"] for r in ranks),
                                  max(r["selected_max"] for r in ranks)]}
    save("soak", {"machine": machine(), "summary": summary, "ranks": ranks})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
