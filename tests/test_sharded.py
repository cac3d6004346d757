"""The sharded exchange (collective="sharded") on real jobs of 2, 3 and 4 ranks, Horovod under
mpirun and horovodrun and the mpi4py transport (tests/workers/sharded_scenarios.py)."""
import pytest

from conftest import run_ranks

pytestmark = pytest.mark.multirank

CONFIGS = [("mpirun", 2, "horovod"), ("horovodrun", 3, "horovod"), ("mpirun", 3, "mpi"),
           ("mpirun", 4, "horovod")]
METHODS = ["topk", "gaussiank", "sbc", "adaptive", "threshold", "randomk"]


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{l}-np{n}-{b}" for l, n, b in CONFIGS])
def sharded(request, tmp_path_factory):
    launcher, np_, backend = request.param
    request.getfixturevalue("mpi4py_available" if backend == "mpi" else "mpi_available")
    out = tmp_path_factory.mktemp(f"sharded-{launcher}-{np_}-{backend}")
    proc, results = run_ranks(launcher, np_, "sharded_scenarios.py", out, timeout=500,
                              env={"HVD_SPARSE_TEST_BACKEND": backend})
    for r in results:
        assert "errors" not in r, f"rank {r['rank']} failed:\n" + "\n".join(r["errors"].values())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return results


@pytest.mark.parametrize("method", METHODS)
def test_replicas_stay_identical(sharded, method):
    """Top-K for 200 steps, every other method for 30: bitwise-identical parameters on every
    rank, the downlink residual held as this rank's region only, and training progresses."""
    for r in sharded:
        assert r[f"replicas_{method}_equal"] and r[f"replicas_{method}_finite"]
        assert r[f"replicas_{method}_loss_fell"]
        assert r[f"replicas_{method}_collective"] == ["sharded"]
        assert all(r[f"replicas_{method}_shards"])


def test_density_one_is_the_dense_average(sharded):
    for r in sharded:
        assert r["dense_average_maxdiff"] <= 1e-6


def test_unidirectional_sharded_equals_allgather_bit_for_bit(sharded):
    for r in sharded:
        assert r["unidirectional_equal"]


def test_resume_from_per_rank_state_is_exact(sharded):
    for r in sharded:
        assert r["resume_shards_saved"] and r["resume_exact"]


def test_uneven_regions(sharded):
    """A bucket with fewer entries than ranks, and all of a gradient in one region."""
    for r in sharded:
        assert r["uneven_equal"] and r["uneven_moved"] and r["uneven_rest_zero"]


def test_nonfinite_step_is_seen_by_every_rank(sharded):
    for r in sharded:
        assert r["nonfinite_steps"] == 1 and r["nonfinite_skipped"] == 1
        assert r["nonfinite_equal"] and r["nonfinite_finite"]


def test_traffic_per_rank_does_not_grow_with_ranks(sharded):
    """Received bytes per rank: the allgather's grow with P - 1 selections, the sharded
    exchange's stay near one uplink selection (all-to-all) plus one downlink selection."""
    p = sharded[0]["size"]
    for r in sharded:
        ag, sh = r["traffic_allgather"], r["traffic_sharded"]
        pair = ag["received"] / ((p - 1) * ag["selected"])  # bytes per received pair
        assert sh["received"] <= 1.3 * pair * (sh["selected"] + sh["downlink_selected"])
        if p >= 4:
            assert sh["received"] < ag["received"]


def test_auto_chooses_per_bucket_the_same_on_every_rank(sharded):
    for r in sharded:
        assert r["auto_same_choices"] and r["auto_equal"] and r["auto_equal_after_switch"]
        assert set(r["auto_choices"].values()) <= {"allgather", "sharded"}
        assert r["auto_choices"] and all(r["auto_switch_keeps_residual"])


def test_global_rule_follows_the_whole_bucket(sharded):
    """k = 20,000 of 2M entries, all the mass in the first 50,000: under the global rule the
    downlink takes about k entries, all there, nearly all of exact global Top-K's; the region
    rule keeps only that region's share of k from it."""
    p = sharded[0]["size"]
    for r in sharded:
        assert r["rule_global_equal"] and r["rule_region_equal"]
        assert 19_500 <= r["rule_global_selected"] <= 20_500
        assert r["rule_global_in_first_region"] and r["rule_global_overlap"] >= 0.97
        assert r["rule_region_overlap"] <= 1.0 / p + 0.05


def test_small_topk_buckets_go_by_allgather_under_the_global_rule(sharded):
    for r in sharded:
        assert r["small_sharded_collectives"] == ["allgather"]
        assert r["small_gathered_equal"]


@pytest.mark.parametrize("method", ["threshold", "topk"])
def test_regions_rebalance_to_the_load(sharded, method):
    """The load sits in the first tenth: the bounds move into it (the first region ends
    inside it), identically on every rank, and the result is that of fixed regions, bit for
    bit, also after a resume. Top-K under the global rule shards this bucket from 3 ranks."""
    p = sharded[0]["size"]
    n = 200_000
    for r in sharded:
        assert r[f"rebalance_{method}_replicas"] and r[f"rebalance_{method}_same_bounds"]
        assert r[f"rebalance_{method}_equals_fixed"] and r[f"rebalance_{method}_resume_exact"]
        if method == "topk" and p == 2:
            assert r[f"rebalance_{method}_collective"] == "allgather"
            continue
        assert r[f"rebalance_{method}_collective"] == "sharded"
        bounds, equal = r[f"rebalance_{method}_bounds"], r[f"rebalance_{method}_equal_bounds"]
        assert r[f"rebalance_{method}_fixed_bounds"] == equal
        assert bounds != equal and bounds[0] == 0 and bounds[-1] == n
        assert 0 < bounds[1] < n // 10
        assert all(a <= b for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("old,new,bidirectional", [(3, 2, True), (2, 4, True), (3, 2, False)])
def test_resume_on_another_rank_count_from_merged_states(mpi_available, tmp_path, old, new,
                                                         bidirectional):
    """Per-rank state dicts of a sharded job, merged with merge_rank_states and loaded on
    another rank count: the merged downlink residual is exactly the regions in rank order
    plus every rank's unsent gradient averaged (no mass lost, no warning), the new job cuts
    its own regions from it and trains on with identical replicas. Without the downlink
    selection there are no regions: the merged residual is the unsent gradients alone, and
    each owner adds its region of it to its first sum (none of it is left after)."""
    env = {"HVD_SPARSE_RESHARD_DIR": str(tmp_path),
           "HVD_SPARSE_RESHARD_UNIDIRECTIONAL": "0" if bidirectional else "1"}
    for np_, name in ((old, "save"), (new, "load")):
        out = tmp_path / name
        out.mkdir()
        proc, results = run_ranks("mpirun", np_, "reshard_scenarios.py", out, name,
                                  timeout=300, env=env)
        for r in results:
            assert "errors" not in r, "\n".join(r["errors"].values())
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(r["old_size"] == old for r in results)
    for r in results:
        assert r["merged_exact"] and r["merged_has_mass"] and r["load_warnings"] == []
        assert r["gathered_before_step_exact"]
        assert r["cut_into_regions"] and r["replicas_equal"] and r["finite"]


def test_consolidated_rank0_checkpoint_keeps_every_region(sharded):
    """consolidate_state_dict() on every rank, then rank 0's state dict: the whole downlink
    residual (regions in rank order), no warning; exact resume from it; loaded on every rank,
    no region dropped. Unconsolidated, rank 0 (only) is warned when it saves."""
    for r in sharded:
        assert r["consolidated_partial_warned"] == (r["rank"] == 0)
        assert not r["consolidated_warned"]
        assert r["consolidated_whole"] and r["consolidated_has_mass"]
        assert r["consolidated_resume_exact"]
        assert not r["consolidated_load_dropped"] and r["consolidated_regions_kept"]
        assert r["consolidated_everywhere_equal"]


def test_rank0_checkpoint_loaded_everywhere(sharded):
    """Rank 0's state dict on every rank: rank 0 gets its region residuals back, the others
    are told theirs start from zero; training goes on with identical replicas."""
    for r in sharded:
        assert r["rank0_ckpt_equal"]
        if r["rank"] == 0:
            assert r["rank0_ckpt_own_restored"] and not r["rank0_ckpt_warned"]
        else:
            assert r["rank0_ckpt_warned"]
