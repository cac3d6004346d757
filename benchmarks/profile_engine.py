"""Where the engine's step time goes: a host profile (cProfile) and, on CUDA, a kernel profile.

    .venv/bin/python benchmarks/profile_engine.py [--device cuda] [--sizes 11.4e6 100e6]
        [--sparsifiers topk sbc] [--steps 6] [--top 18]

For each size and sparsifier the engine of benchmarks/engine.py (one parameter, P payloads
synthesised, no network) runs ``--steps`` synchronised steps under cProfile, then again under
``torch.profiler`` when the device is CUDA. Printed: the functions with the most own host time,
and on CUDA the kernels with the most device time next to the step's wall time, so a gap
between the two (host waits, launch overhead, syncs) is visible. Raw tables go to
benchmarks/results/profile_engine_<device>.json.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from common import machine, save
from engine import build


def host_profile(opt, p, grads, steps, sync, top):
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    for step in range(steps):
        p.grad = grads[step % 3].clone()
        prof.enable()
        opt.synchronize()
        sync()
        prof.disable()
    wall = (time.perf_counter() - t0) / steps
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in stats.stats.items():
        rows.append({"function": f"{file.rsplit('/', 2)[-1]}:{line}:{fn}", "calls": nc / steps,
                     "own_ms": 1e3 * tt / steps, "cum_ms": 1e3 * ct / steps})
    rows.sort(key=lambda r: -r["own_ms"])
    return wall, rows[:top]


def device_profile(opt, p, grads, steps, top):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for step in range(steps):
            p.grad = grads[step % 3].clone()
            opt.synchronize()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "self_cuda_time_total", 0)
        if dev_us:
            rows.append({"name": ev.key[:90], "calls": ev.count / steps,
                         "device_ms": dev_us / 1e3 / steps})
    rows.sort(key=lambda r: -r["device_ms"])
    return sum(r["device_ms"] for r in rows), rows[:top]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", type=float, default=[11.4e6])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--sparsifiers", nargs="+", default=["topk"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    out = []
    for n in args.sizes:
        for sp in args.sparsifiers:
            opt, p, grads = build(int(n), args.ranks, args.density, args.device, args.steps, sp)
            for step in range(2):  # warm-up: kernels compiled, buffers allocated, agreement done
                p.grad = grads[step].clone()
                opt.synchronize()
            sync()
            wall, host = host_profile(opt, p, grads, args.steps, sync, args.top)
            row = {"n": int(n), "sparsifier": sp, "ranks": args.ranks, "wall_ms": wall * 1e3,
                   "host": host}
            print(f"\n== {sp} n={int(n):,} P={args.ranks} on {args.device}: "
                  f"{wall * 1e3:.2f} ms per step (under cProfile)")
            for r in host:
                print(f"  host {r['own_ms']:8.3f} ms own {r['cum_ms']:8.3f} cum "
                      f"{r['calls']:6.1f}x  {r['function']}")
            if args.device == "cuda":
                busy, kernels = device_profile(opt, p, grads, args.steps, args.top)
                row.update(device_busy_ms=busy, device=kernels)
                print(f"  device busy {busy:.2f} ms per step")
                for r in kernels:
                    print(f"  dev  {r['device_ms']:8.3f} ms {r['calls']:6.1f}x  {r['name']}")
            out.append(row)
    save(f"profile_engine_{args.device}", {"machine": machine(), "rows": out})


if __name__ == "__main__":
    main()
