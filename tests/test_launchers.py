"""The launchers users run: the slow-network namespace really limits traffic; the CLI runs each
workload end to end on 2 ranks with metrics written and parsed."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, _env

pytestmark = pytest.mark.multirank

SLOWNET = str(ROOT / "launch" / "slownet.sh")


def _can_shape():
    if shutil.which("tc") is None or shutil.which("unshare") is None:
        return "tc or unshare is not installed (iproute2, util-linux)"
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        return "cannot create a network namespace here (needs root or CAP_SYS_ADMIN)"
    return None


PROBE = r"""
import json, sys, time, torch
import hvd_sparse as hvd
hvd.init()
t = torch.zeros(1_000_000, dtype=torch.uint8)
hvd.allgather(t, name="warm")
hvd.allreduce(torch.zeros(1), name="sync")
start = time.perf_counter()
hvd.allgather(t, name="measure")
took = time.perf_counter() - start
if hvd.rank() == 0:
    print(json.dumps({"took": took, "size": hvd.size()}))
"""


@pytest.mark.skipif(_can_shape() is not None, reason=str(_can_shape()))
def test_slow_network_launcher_limits_traffic(mpi_available):
    rate_bits = 40e6  # 40 Mbit/s
    proc = subprocess.run([SLOWNET, "40mbit", "2", "--", sys.executable, "-c", PROBE],
                          capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rec = json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])
    # each rank receives the other's 1 MB across the shaped link
    floor = 1e6 * 8 / rate_bits
    assert rec["took"] >= 0.9 * floor, rec
    fast = subprocess.run([SLOWNET, "none", "2", "--", sys.executable, "-c", PROBE],
                          capture_output=True, text=True, timeout=300, env=_env())
    assert fast.returncode == 0, fast.stderr[-2000:]
    unshaped = json.loads([l for l in fast.stdout.splitlines() if l.startswith("{")][-1])
    assert unshaped["took"] < rec["took"]


def test_slow_network_launcher_usage_error():
    proc = subprocess.run([SLOWNET, "1gbit"], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stderr


@pytest.mark.parametrize("workload", [
    ["--dataset", "fashion-mnist", "--model", "resnet", "--train-limit", "1024",
     "--test-limit", "500", "--sparsifier", "gaussiank"],
    ["--dataset", "shakespeare", "--model", "lstm", "--steps-per-epoch", "8",
     "--sparsifier", "sbc"],
    ["--dataset", "fortunes", "--model", "gru", "--steps-per-epoch", "8"],
], ids=["fashion-resnet", "shakespeare-lstm", "fortunes-gru"])
def test_cli_workloads_end_to_end(tmp_path, workload, mpi_available):
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "hvd_sparse.train", "--ranks", "2", "--epochs", "2",
           "--no-progress", "--metrics", str(metrics), *workload]
    env = _env()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(l) for l in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in recs] == [1, 2]
    assert all(r["ranks"] == 2 and r["bytes_sent"] < r["dense_bytes"] for r in recs)
    key = "test_accuracy" if "--model" in workload and "resnet" in workload else "valid_loss"
    assert all(key in r for r in recs)
    if key == "valid_loss":
        assert recs[-1]["valid_loss"] < 4.5  # below log(96) and log(113), the uniform guess


def test_benchmark_mode_reports_step_times():
    proc = subprocess.run([sys.executable, "-m", "hvd_sparse.train", "--optimizer", "local",
                           "--model", "cnn", "--benchmark-steps", "3"],
                          capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])
    assert rec["steps"] == 3 and rec["step_s_median"] > 0 and rec["ranks"] == 1
