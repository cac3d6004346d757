"""hvd.elastic with hvd_sparse: a real horovodrun job that grows from 2 to 3 workers and shrinks
back (tests/workers/elastic_worker.py). Survivors and the joining worker must run the same
collectives (no hang) and end with bitwise-equal parameters and replicated state."""
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import WORKERS, _env

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("collective", ["default", "sharded", "updates", "updates_timed",
                                        "adam_timed"])
def test_elastic_join_and_removal_keep_replicas_identical(tmp_path, mpi_available, collective):
    """Also with every bucket sharded: at each world change the survivors' regions are
    gathered and cut again for the new world; only the departed worker's are lost. And with
    the library's choice for SGD with momentum, its updates (each rank's own velocity;
    TorchState's restore broadcasts rank 0's), also under the time cost model with a dense
    exchange priced free, so every bucket goes dense (the worker fixes the price: measured,
    this small model's choice is a near tie that a loaded runner tipped either way): a
    switch to Horovod's step there made the survivors exchange gradients beside a joiner
    exchanging updates (a configuration mismatch, the job stopped). Adam takes that switch (``adam_timed``): it is replicated
    state, which the joiner takes from the survivors before its first exchange (it
    exchanged updates beside their gradients)."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    horovodrun = Path(sys.executable).parent / "horovodrun"
    cmd = [str(horovodrun), "--network-interfaces", "lo", "-np", "2", "--min-np", "2",
           "--max-np", "3", "--host-discovery-script", str(discover), sys.executable,
           str(WORKERS / "elastic_worker.py"), str(tmp_path), str(hosts)]
    try:
        updates = collective.startswith("updates")
        adam = collective == "adam_timed"
        env = dict(_env(), HVD_SPARSE_TEST_COLLECTIVE=collective,
                   HVD_SPARSE_TEST_EXCHANGE="auto" if updates or adam else "gradient",
                   HVD_SPARSE_TEST_OPTIMIZER="adam" if adam else "sgd",
                   HVD_SPARSE_TEST_COST="time" if collective.endswith("_timed") else "off")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"elastic job hung:\n{e.stdout}\n{e.stderr}")
    results = []
    for r in range(2):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote nothing:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        results.append(__import__("json").loads(path.read_text()))
    for r in results:
        assert 3 in r["sizes"], r["sizes"]  # a worker joined and trained
        assert r["sizes"][:3] == [2, 2, 2] and r["sizes"][-1] == 2, r["sizes"]  # and left
        assert r["params_equal"] and r["downlink_equal"] and r["steps_equal"], r
        assert r["finite"]
        assert r["exchange"] == ("update" if updates else "gradient")
        if collective.endswith("_timed"):
            assert r["modes"] == ["dense"], r  # (the case a switch would have taken)
        if adam:  # switched before the join: the joiner took it
            assert r["exchange_before_join"] == "gradient", r
        assert r["steps"] == r["batch"]  # one exchange per batch, counters carried across
        assert r["collectives"] == (["sharded"] if collective == "sharded" else ["allgather"])
        # the join loses nothing; the shrink loses the departed worker's regions, said once
        assert not any("unsent aggregate is dropped" in w for w in r["region_warnings"]), r
        assert all("departed" in w for w in r["region_warnings"]), r
        assert len(r["region_warnings"]) == (1 if collective == "sharded" else 0), r
