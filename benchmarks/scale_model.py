"""Fit the measured step times to the latency-bandwidth cost model and extrapolate to 1024 ranks.

    .venv/bin/python benchmarks/scale_model.py      (after benchmarks/network.py)

Model, per step, for a model of N float32 parameters at density d (k = dN entries of 8 bytes):
    ring allreduce (dense):  T = 2 (P-1) a + 2 (P-1)/P * 4N / B
    allgather (sparse):      T = c + (P-1) a + (P-1) * 8k / B
    sharded (sparse):        T = c + 2 (P-1) a + 2 (P-1)/P * 8k / B
                             (an all-to-all of the uplink selection, an allgather of the
                             owners' selections at the same density)
    hvd_sparse with the dense fallback: the smaller of the two (decided per bucket by bytes)
These are per-rank costs on a switched network where every rank has its own link of bandwidth B.
The measurements come from ``launch/slownet.sh``, where all ranks share ONE shaped link, so the
fit uses the shared-link form (total bytes over the link: P times the per-rank bytes):
    dense:  2 (P-1) a + 2 (P-1) * 4N / B        sparse:  c + (P-1) a + P (P-1) * 8k / B
Per shaped rate, ``a`` (per-message latency) and ``B`` (bandwidth) are fitted to the dense runs'
communication time (step time minus the no-communication floor), and ``c`` (the sparse path's
own cost per step: selection, aggregation, downlink, on these CPUs) to the Top-K runs given
``a`` and ``B``. The fit uses the measured 2- and 4-rank points; all else is extrapolation.
Results: benchmarks/results/scale_model.json and scale_model.png.
"""
from __future__ import annotations

import json

import numpy as np

from common import RESULTS, machine, save


def design(opt, p, n, density):
    if opt == "dense":
        return 2 * (p - 1), 2 * (p - 1) / p * 4 * n
    k = density * n
    if opt == "sharded":
        return 2 * (p - 1), 2 * (p - 1) / p * 8 * k
    return (p - 1), (p - 1) * 8 * k


def engine_compute_s(n):
    """The engine's own time per step for Top-K 1% at the benchmark size nearest ``n``."""
    path = RESULTS / "engine_cpu.json"
    if not path.exists():
        return None
    rows = [r for r in json.loads(path.read_text())["rows"] if r["sparsifier"] == "topk"]
    return min(rows, key=lambda r: abs(r["n"] - n))["engine_s"] if rows else None


def fit(points):
    """Least squares for T = x_lat * a + x_bytes / B with a, 1/B >= 0."""
    A = np.array([[x_lat, x_bytes] for x_lat, x_bytes, _ in points], dtype=float)
    y = np.array([t for _, _, t in points], dtype=float)
    sol, *_ = np.linalg.lstsq(A, y, rcond=None)
    if sol[0] < 0:  # latency not resolvable: bandwidth alone
        sol = [0.0, max(float(np.dot(A[:, 1], y) / np.dot(A[:, 1], A[:, 1])), 1e-12)]
    a, inv_b = max(sol[0], 0.0), max(sol[1], 1e-12)
    return a, 1.0 / inv_b


def main():
    data = json.loads((RESULTS / "network.json").read_text())
    rows = [r for r in data["rows"] if r["model"] == "mlp11m" and r["rate"] != "-"]
    fits = {}
    for rate in sorted({r["rate"] for r in rows}):
        # rows measured without a floor at their rank count cannot be fitted
        dense = [r for r in rows if r["rate"] == rate and r["optimizer"] == "dense"
                 and r.get("floor_s") is not None]
        if not dense:  # nothing to fit latency and bandwidth to at this rate
            continue
        # shared link: the link carries every rank's bytes (P x the per-rank ring volume)
        pts = [(2 * (r["ranks"] - 1), 2 * (r["ranks"] - 1) * 4 * r["parameters"],
                max(r["step_s"] - r["floor_s"], 0.0)) for r in dense]
        a, b = fit(pts)
        sparse = [r for r in rows if r["rate"] == rate and r["optimizer"] == "topk"
                  and r.get("floor_s") is not None]
        over = [max(r["step_s"] - r["floor_s"] - (r["ranks"] - 1) * a
                    - r["ranks"] * (r["ranks"] - 1) * 8 * r.get("density", 0.01)
                    * r["parameters"] / b, 0.0)
                for r in sparse]
        c = float(np.mean(over)) if over else 0.0
        fits[rate] = {"latency_s": a, "bandwidth_Bps": b, "sparse_overhead_s": c,
                      "points": len(pts) + len(over)}
        print(f"{rate:8}: latency {a * 1e3:.2f} ms, bandwidth {b * 8 / 1e6:.1f} Mbit/s, "
              f"sparse overhead {c * 1e3:.0f} ms/step")
    n = 11_388_010
    if "1gbit" in fits:
        fits["10gbit (assumed)"] = dict(fits["1gbit"], bandwidth_Bps=10 * fits["1gbit"][
            "bandwidth_Bps"], points=0)
    engine_c = engine_compute_s(n)
    ranks = np.unique(np.logspace(1, 10, 40, base=2).astype(int))
    curves = {}
    for rate, f in fits.items():
        for density in (0.01, 0.001):
            dense = [design("dense", p, n, density) for p in ranks]
            sparse = [design("topk", p, n, density) for p in ranks]
            shard = [design("sharded", p, n, density) for p in ranks]
            td = [x * f["latency_s"] + y / f["bandwidth_Bps"] for x, y in dense]
            # both sparse collectives with the same compute constant: the engine's own time
            # (the fitted end-to-end overhead when there is no engine measurement)
            c_sh = engine_c if engine_c is not None else f["sparse_overhead_s"]
            ts = [c_sh + x * f["latency_s"] + y / f["bandwidth_Bps"] for x, y in sparse]
            tsh = [c_sh + x * f["latency_s"] + y / f["bandwidth_Bps"] for x, y in shard]
            wins = [s < d for d, s in zip(td, ts)]
            cross = next((int(p) for p, d, s, w in zip(ranks, td, ts, wins)
                          if s >= d and any(wins[:list(ranks).index(p)])), None)
            sh_wins = [s < d for d, s in zip(td, tsh)]
            curves[f"{rate}/{density}"] = {"ranks": ranks.tolist(), "dense_s": td, "sparse_s": ts,
                                           "fallback_s": [min(d, s) for d, s in zip(td, ts)],
                                           "sharded_s": tsh, "sharded_compute_s": c_sh,
                                           "allgather_stops_paying_at": cross,
                                           "sharded_beats_dense_up_to": max(
                                               (int(p) for p, w in zip(ranks, sh_wins) if w),
                                               default=None),
                                           "sharded_beats_dense_everywhere": all(sh_wins)}
            note = (f"stops paying at {cross} ranks" if cross else
                    "pays up to 1024 ranks" if all(wins) else
                    "never pays" if not any(wins) else "pays in places")
            curves[f"{rate}/{density}"]["summary"] = note
            sh = curves[f"{rate}/{density}"]
            print(f"{rate:8} density {density}: allgather {note}; sharded "
                  + ("beats ring allreduce at every rank count to 1024"
                     if sh["sharded_beats_dense_everywhere"] else
                     f"beats ring allreduce up to {sh['sharded_beats_dense_up_to']} ranks"))
    save("scale_model", {"machine": machine(), "model_parameters": n, "fits": fits,
                         "curves": curves})
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, c in curves.items():
        if not key.endswith("/0.01"):
            continue
        line, = ax.loglog(c["ranks"], c["sparse_s"], "--", label=f"allgather {key}")
        ax.loglog(c["ranks"], c["sharded_s"], "-", color=line.get_color(),
                  label=f"sharded {key}")
    for rate in fits:
        c = curves[f"{rate}/0.01"]
        ax.loglog(c["ranks"], c["dense_s"], ":", color="k", label=f"ring allreduce {rate}")
    ax.set_xlabel("ranks")
    ax.set_ylabel("communication time per step (s), 11.4M parameters")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(RESULTS / "scale_model.png", dpi=110)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
