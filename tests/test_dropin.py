"""A Horovod user's patterns on real 2-rank jobs: resume from rank 0's checkpoint, GradScaler,
non-finite gradients under every policy, sparse embeddings (tests/workers/dropin_scenarios.py)."""
import math

import pytest

from conftest import run_ranks

pytestmark = pytest.mark.multirank

# the last: every bucket sharded, at the rank count from which "auto" (the default) shards
CONFIGS = [("mpirun", 2, "horovod", "default"), ("mpirun", 2, "mpi", "default"),
           ("mpirun", 4, "horovod", "sharded")]


@pytest.fixture(scope="module", params=CONFIGS,
                ids=[f"{l}-np{n}-{b}-{c}" for l, n, b, c in CONFIGS])
def dropin(request, tmp_path_factory):
    launcher, np_, backend, collective = request.param
    request.getfixturevalue("mpi4py_available" if backend == "mpi" else "mpi_available")
    out = tmp_path_factory.mktemp(f"dropin-{backend}-{np_}")
    proc, results = run_ranks(launcher, np_, "dropin_scenarios.py", out, timeout=400,
                              env={"HVD_SPARSE_TEST_BACKEND": backend,
                                   "HVD_SPARSE_TEST_COLLECTIVE": collective})
    for r in results:
        assert "errors" not in r, f"rank {r['rank']} failed:\n" + "\n".join(r["errors"].values())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return results


def test_collective_is_the_configured_one(dropin):
    """The 4-rank configuration really runs every bucket through the sharded exchange."""
    for r in dropin:
        assert r["collectives"] == (["sharded"] if r["size"] == 4 else ["allgather"])


def _keys(results, prefix):
    keys = sorted({k.rsplit("_", 1)[0] for k in results[0] if k.startswith(prefix)
                   and k.endswith("_steps")})
    assert keys, f"no {prefix} results"
    return keys


def test_resume_from_rank0_checkpoint_with_broadcast_optimizer_state(dropin):
    """Horovod's broadcast_optimizer_state (and hvd_sparse's) after rank 0 alone loaded: no
    hang, base state equal, and hvd_sparse's replicated state is rank 0's on every rank; with
    hvd_sparse's, the parameters are equal at once, weight decay included."""
    for key in _keys(dropin, "resume_"):
        for r in dropin:
            assert r[f"{key}_base_state_equal"] and r[f"{key}_base_state_nonempty"], key
            saved, now = r[f"{key}_steps"]
            assert now == saved + 1, (key, saved, now)  # counters continue from rank 0's
            assert r[f"{key}_params_equal"], key
            if "horovod" not in key:  # (Horovod's own function moves fresh ranks' weights)
                assert r[f"{key}_params_equal_at_once"], key
            assert r[f"{key}_downlink_equal"], key
            assert r[f"{key}_sparsifier_equal"] and r[f"{key}_sparsifier_kept"], key
            assert r[f"{key}_then_equal"], key


def test_a_fresh_state_is_broadcast_as_horovods_on_every_front_end(dropin):
    for r in dropin:
        assert r["fresh_state"] == [1.0, 0.0]  # Horovod's initialising step, zero moments
        assert r["fresh_params_kept"]


def test_broadcast_optimizer_state_mid_run_reunites_replicas(dropin):
    for r in dropin:
        assert r["midrun_steps"] == 5  # rank 0's old state (4 steps) plus one
        assert r["midrun_params_equal"] and r["midrun_downlink_equal"]
        assert not r["midrun_broadcast_warned"]  # a broadcast is not a rank-0 checkpoint


@pytest.mark.parametrize("prefix", ["amp", "amp_update", "amp_update_fused",
                                    "amp_update_fused_torch", "amp_torch",
                                    "amp_torch_clip", "amp_horovod_clip", "amp_torch_fused",
                                    "amp_sgd_updates", "amp_sgd_updates_torch"])
def test_gradscaler_sees_overflow_on_every_rank(dropin, prefix):
    """The default policy hands an overflow on one rank to every rank's p.grad: each scaler
    skips the step and halves its scale; residuals are untouched; training goes on. Also with
    exchange="update" (AdamW), where synchronize() agrees on finiteness only."""
    for r in dropin:
        assert r[f"{prefix}_nonfinite_grads"] == [i == 3 for i in range(8)]
        assert r[f"{prefix}_stepped"] == [i != 3 for i in range(8)]
        scales = r[f"{prefix}_scales"]
        assert scales[3] == scales[2] / 2 and scales[0] == scales[2] == 2.0 ** 10
        assert r[f"{prefix}_uplink_untouched"] and r[f"{prefix}_downlink_untouched"]
        assert r[f"{prefix}_residuals_finite"] and r[f"{prefix}_params_finite"]
        assert r[f"{prefix}_params_equal"]
        assert r[f"{prefix}_stats_nonfinite"] >= 1
        assert r.get(f"{prefix}_exchange", "update") == "update"  # (SGD's: the library's choice)
    assert len({tuple(r[f"{prefix}_scales"]) for r in dropin}) == 1


def test_a_fused_adamw_unscaling_inside_its_step_corrects_on_unscaled_gradients(dropin):
    """Fused AdamW's updates under torch's recipe: the scaler hands the scale to the step,
    which unscales inside; the second moment's correction reads the gradients unscaled too,
    so the run ends where Horovod's pattern (unscale_ first) ends, to rounding (read scaled,
    the pre-image put in for the step went negative)."""
    for r in dropin:
        a, b = r["amp_update_fused_torch_params"], r["amp_update_fused_params"]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5


@pytest.mark.parametrize("torch_recipe, horovod_recipe", [("amp_torch", "amp"),
                                                          ("amp_torch_clip", "amp_horovod_clip")])
def test_torchs_gradscaler_recipe_trains_as_horovods_amp_pattern(dropin, torch_recipe,
                                                                 horovod_recipe):
    """``scaler.step(optimizer)`` with no ``synchronize()`` first (torch's recipe; with
    ``scaler.unscale_`` and clipping too): the scaler unscales the exchanged gradient, so the
    run is bit for bit the one of Horovod's AMP pattern, with no warning (the step was taken
    with the loss scale still in the gradient, 785 times too large, and under Horovod the
    unscale races the in-place allreduce)."""
    for r in dropin:
        assert r[f"{torch_recipe}_params"] == r[f"{horovod_recipe}_params"]
        assert not r[f"{torch_recipe}_warnings"], r[f"{torch_recipe}_warnings"]


def test_bfloat16_model_through_the_start_of_training_broadcasts(dropin):
    for r in dropin:
        assert r["bf16_params_equal"] and r["bf16_momentum_equal"] and r["bf16_then_equal"]
        assert r["bf16_momentum_dtype"] == ["torch.bfloat16"]


@pytest.mark.parametrize("policy", ["skip", "propagate"])
@pytest.mark.parametrize("recipe", ["plain", "synchronize"])
def test_exchanged_updates_skip_a_nonfinite_step_on_every_rank(dropin, policy, recipe):
    """Adam's updates exchanged, an Inf on one rank: that step moves nothing on any rank
    (no local step, no exchange of what the residuals hold), Adam's step count and the
    exchange counter agree everywhere, and training goes on."""
    key = f"upd_nf_{policy}_{recipe}"
    for r in dropin:
        assert r[f"{key}_moved"] == [True, True, False, True, True], r[f"{key}_moved"]
        assert r[f"{key}_adam_steps"] == [1.0, 2.0, 2.0, 3.0, 4.0]
        assert r[f"{key}_exchanges"] == 4
        assert r[f"{key}_equal"] and r[f"{key}_finite"]


@pytest.mark.parametrize("case", ["adaptive_skip", "sbc_skip", "sbc_raise",
                                  "gaussiank_propagate", "momentum_propagate"])
def test_nonfinite_policy_is_the_same_on_every_rank(dropin, case):
    # every rank did the same thing (the message also names what this rank saw)
    errors = {(r[f"nf_{case}_error"] or "").split(":")[0] or None for r in dropin}
    assert len(errors) == 1, errors
    (error,) = errors
    if case.endswith("_raise"):
        assert error == "NonFiniteGradientError", error
    else:
        assert error is None, error
    for r in dropin:
        assert r[f"nf_{case}_uplink_rolled_back"]
        assert r[f"nf_{case}_sparsifier_rolled_back"]
        assert r[f"nf_{case}_then_equal"]
        if not case.endswith("_propagate"):  # propagate applies the NaN, as dense Horovod
            assert r[f"nf_{case}_finite"]


def test_skip_on_a_dense_bucket_keeps_its_residual(dropin):
    for r in dropin:
        assert r["dense_skip_uplink_kept"]
        assert r["dense_skip_flushed_after"]
        assert r["dense_skip_equal"]


def test_local_steps_never_apply_a_nonfinite_gradient(dropin):
    for r in dropin:
        assert r["local_nan_finite"] and r["local_nan_equal"]
        # "raise": every rank raises at the exchange, back where the last one left them
        assert r["local_nan_raise_steps"] == [5], r
        assert r["local_nan_raise_restored"] and r["local_nan_raise_equal"], r
        assert r["local_nan_raise_finite"]


@pytest.mark.parametrize("scope", ["tensor", "model"])
def test_sparse_embedding_with_nan_on_one_rank(dropin, scope):
    for r in dropin:
        assert r[f"emb_{scope}_skip_errors"] == []
        assert r[f"emb_{scope}_skip_finite"] and r[f"emb_{scope}_skip_equal"]
        assert r[f"emb_{scope}_raise_errors"] == ["NonFiniteGradientError"]
        assert r[f"emb_{scope}_raise_equal"]
        assert r[f"emb_{scope}_propagate_errors"] == []
        assert r[f"emb_{scope}_propagate_finite_flags"] == [False] * len(dropin)


@pytest.mark.parametrize("case", ["adagrad_1.0", "adagrad_0.2", "sgd_0.2"])
def test_a_sparse_gradient_missing_on_one_rank_comes_back_in_the_others_layout(dropin, case):
    for r in dropin:
        assert r[f"emb_unused_{case}_layouts_equal"], r[f"emb_unused_{case}_sparse"]
        assert r[f"emb_unused_{case}_sparse"] == [True] * 6
        assert r[f"emb_unused_{case}_equal"]


def test_adam_takes_horovods_step_once_every_bucket_goes_dense(dropin):
    for r in dropin:
        assert r["adam_dense_kinds"][0] == "update" and r["adam_dense_kinds"][-1] == "gradient"
        assert r["adam_dense_state_equal"] and r["adam_dense_params_equal"]
        assert r["adam_dense_horovods_step"] < 1e-6  # (averaged own steps: about 1e-3 apart)
        assert r["adam_dense_then_equal"]
        assert r["adam_dense_frozen_kept"]
        assert r["adam_dense_after_recalibration"] == ["gradient", ["dense"]]


def test_adams_switch_to_horovods_step_is_taken_from_rank_0_at_a_resume(dropin):
    """Rank 0 alone loads a state saved after the all-dense switch; the fresh ranks, on
    updates, take the switch from it at the agreement (they hung beside its gradients). And
    the reverse, where rank 0 loads a state from before the switch, mid-run, with
    hvd_sparse's broadcast: the switched ranks go back to updates. The link is priced slow
    after the resume: only the adopted switch keeps Horovod's step."""
    keys = sorted({k[:-len("_kinds")] for k in dropin[0] if k.startswith("switch_resume_")
                   and k.endswith("_kinds")})
    assert len(keys) in (2, 3), keys  # (Horovod's own broadcast: the switched case only)
    for r in dropin:
        for key in keys:
            assert r[f"{key}_error"] is None, (key, r[f"{key}_error"])
            assert r[f"{key}_params_equal"], key
            if key.endswith("_switched"):
                assert r[f"{key}_kinds"] == ["update"] + ["gradient"] * 4, (key, r)
                assert r[f"{key}_state_equal"], key
                assert r[f"{key}_horovods_step"] < 1e-6, key
            else:
                assert r[f"{key}_kinds"] == ["gradient"] + ["update"] * 4, (key, r)


def test_a_switchable_rank_beside_explicit_updates_is_a_configuration_mismatch(dropin):
    for r in dropin:
        assert r["switchable_beside_explicit_error"] == "ConfigMismatchError"


def test_sgd_momentum_keeps_its_updates_once_every_bucket_goes_dense(dropin):
    for r in dropin:
        assert r["sgd_dense_kinds"] == ["update"] * 7
        assert r["sgd_dense_modes"][-1] == ["dense"]
        assert r["sgd_dense_params_equal"]
        assert r["sgd_dense_twin_apart"] < 1e-5  # Horovod's step, to rounding


def test_sparseadam_steps_a_rank_that_left_its_embedding_out(dropin):
    for r in dropin:
        assert r["emb_unused_sparseadam_errors"] == []
        assert r["emb_unused_sparseadam_equal"]


def test_update_exchange_keeps_replicas_identical(dropin):
    for r in dropin:
        assert r["update_params_equal"] and r["update_moved"] > 1e-3
        assert r["update_adam_state_per_rank"]  # each rank's AdamW saw its own gradients


def test_adamw_updates_step_on_the_full_batchs_second_moment(dropin):
    """On by default for AdamW's exchanged updates; each rank's own state resumes it bit for
    bit (its noise estimates are saved), replicas stay identical, and it changes the steps."""
    for r in dropin:
        assert r["update_variance_correction"] is True
        assert r["update_corrected_resume_exact"] and r["update_corrected_equal"]
        assert r["update_corrected_counts"] == [5] * 4  # (four tensors, five differences)
        assert r["update_corrected_differs"] > 1e-6


@pytest.mark.parametrize("exchange", ["update", "gradient"])
def test_step_hooks_fire_once_and_post_hooks_see_the_exchanged_parameters(dropin, exchange):
    """An EMA or a weight constraint in a step post-hook works on the replicas' parameters:
    with exchanged updates the post-hooks once ran before the exchange, on each rank's own."""
    for r in dropin:
        assert r[f"hooks_{exchange}_calls"] == ["global pre", "pre", "post", "global post"] * 6
        assert r[f"hooks_{exchange}_post_saw_replicas"]
        assert r[f"hooks_{exchange}_post_saw_result"]


@pytest.mark.parametrize("hook", ["clip", "relayout"])
@pytest.mark.parametrize("density", ["1", "0.1"])
def test_a_gradient_hook_registered_after_wrapping_is_exchanged(dropin, hook, density):
    """Horovod hooks where a post-accumulate-grad hook added later still runs first: a clip
    (or a layout change of ``p.grad``) registered after wrapping gives the result of the same
    hook registered before, on every rank (dense buckets raced it, sparse ones missed it)."""
    for r in dropin:
        assert r[f"late_hook_{hook}_{density}_equal"]
        assert r[f"late_hook_{hook}_{density}_replicas"]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "adamw_clip", "sgd_regrad"])
def test_non_contiguous_parameters_train_as_row_major_ones(dropin, optimizer):
    """channels_last and transposed parameters: gradients (SGD) and updates (AdamW, also with
    local clipping) exchanged by logical position, bit for bit the row-major run, layout kept;
    also when the user replaced ``p.grad`` after backward with one in the parameter's layout
    (the sparse write and the local clipping took ``view(-1)`` of it and failed)."""
    for r in dropin:
        assert r[f"layout_{optimizer}_equal"] and r[f"layout_{optimizer}_replicas"]
        assert r[f"layout_{optimizer}_moved"] > 1e-3
        assert r[f"layout_{optimizer}_rowmajor_kept"] and r[f"layout_{optimizer}_strided_kept"]


@pytest.mark.parametrize("case", ["all", "root_only"])
def test_broadcast_optimizer_state_of_channels_last_and_transposed_moments(dropin, case):
    """Adam's moments in a channels_last / transposed layout: the root's on every rank, layout
    kept, then training in step (Horovod's broadcast refused them as non-contiguous)."""
    for r in dropin:
        assert r[f"strided_bcast_{case}_error"] is None, r[f"strided_bcast_{case}_error"]
        assert r[f"strided_bcast_{case}_equal"] and r[f"strided_bcast_{case}_kept"]
        assert r[f"strided_bcast_{case}_trained_equal"]


def test_switch_to_horovods_step_averages_strided_moments(dropin):
    """Every bucket dense (priced free): Adam's switch to Horovod's step averages moments in a
    channels_last / transposed layout (it failed as non-contiguous), layouts kept."""
    for r in dropin:
        assert r["strided_switch_error"] is None, r["strided_switch_error"]
        assert r["strided_switch_kinds"][0] == "update"
        assert r["strided_switch_kinds"][-1] == "gradient"
        assert r["strided_switch_state_equal"] and r["strided_switch_params_equal"]
        assert r["strided_switch_layout_kept"]


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_bfloat16_parameters_train_under_adam_with_variance_correction(dropin, name):
    for r in dropin:
        assert r[f"bf16_{name}_error"] is None, r[f"bf16_{name}_error"]
        assert r[f"bf16_{name}_corrected"] is True
        assert r[f"bf16_{name}_equal"] and r[f"bf16_{name}_moved"] > 1e-3


@pytest.mark.parametrize("how", ["dict", "list", "generator"])
def test_broadcast_parameters_takes_a_channels_last_model(dropin, how):
    """``hvd.broadcast_parameters(model.state_dict(), root)`` of a channels_last model: the
    root's values everywhere, layout kept (Horovod's own refuses non-contiguous tensors)."""
    for r in dropin:
        assert r[f"layout_broadcast_{how}_from_root"]
        assert r[f"layout_broadcast_{how}_kept"]


def test_bfloat16_gradients_are_averaged_where_horovod_refuses_them(dropin):
    for r in dropin:
        assert r["bf16_ranks_differ"] and r["bf16_dense_mean"]
        assert r["bf16_dtypes"] == ["torch.bfloat16"] * 2 and r["bf16_replicas"]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_step_with_a_closure_exchanges_the_closures_gradients(dropin, optimizer):
    for r in dropin:
        assert r[f"closure_{optimizer}_losses_equal"]
        assert r[f"closure_{optimizer}_equal"] and r[f"closure_{optimizer}_replicas"]


def test_checkpoint_loads_with_torch_load_defaults(dropin):
    for r in dropin:
        assert r["weights_only_loads"] and set(r["weights_only_loads"].values()) == {"ok"}, \
            r["weights_only_loads"]
        costs = [k for k in r if k.startswith("weights_only_") and k.endswith("_costs_plain")]
        assert len(costs) == 7 and all(r[k] for k in costs)


def test_tensor_helpers_around_the_optimizer(dropin):
    n = len(dropin)
    for r in dropin:
        last = [float(n - 1 + i) for i in range(4)]
        assert r["helpers_broadcast"] == last and r["helpers_broadcast_left_input"]
        assert r["helpers_broadcast_"] == last
        assert r["helpers_allreduce_"] == [float(sum(range(n)))] * 3
        assert r["helpers_allreduce"] == [sum(range(n)) / n]
        assert r["helpers_sizes"] == [n, 0, 1]  # one node
        assert r["helpers_allreduce_parameter"] == [sum(range(n)) / n] * 2
    assert dropin[0]["helpers_rank0_alone"] == [n, 1, 0]


def test_collective_helpers_take_horovods_calls(dropin):
    """What Horovod's own tests call, answered as Horovod answers it (under Horovod these are
    its functions, the reference; under hvd_sparse.mpi they are ours): ``average=False``,
    integer sums and truncated averages, gradients through allreduce, allgather and broadcast,
    a plain list of tensors to broadcast_parameters, a lambda as an object, Horovod's
    optimizer arguments by position."""
    n = len(dropin)
    total = n * (n + 1) // 2
    for r in dropin:
        assert r["helpers_average_false"] == [float(total)]
        assert r["helpers_int_sum"] == [[total, 7 * total], "torch.int32"]
        assert r["helpers_int_average"] == [int(total / n), int(7 * total / n)]
        assert r["helpers_allreduce_grad"] == [0.0, float(n), 2.0 * n]
        rank = r["rank"]
        offset = rank * (rank + 1) // 2  # rows of the ranks before this one
        weights = [(offset + i + 1) for i in range(rank + 1)]
        assert r["helpers_allgather_grad"][0] == [total, 2]
        # Horovod's allgather gradient: the output's gradient averaged over ranks, own rows
        assert r["helpers_allgather_grad"][1] == [[float(w)] * 2 for w in weights]
        assert r["helpers_broadcast_grad"] == ([3.0, 3.0] if rank == 0 else [0.0, 0.0])
        assert r["helpers_broadcast_parameter_list"] == [[float(n - 1)] * 2,
                                                         [10.0 + n - 1] * 3]
        assert r["helpers_broadcast_lambda"] == 2 * (3 + n - 1)
        # process_set= taken where Horovod takes it; a root outside the job: ValueError
        assert r["helpers_object_process_set"] == n - 1
        assert r["helpers_bad_root"] == {"broadcast": "ValueError",
                                         "broadcast_object": "ValueError"}
        assert r["helpers_positional_options"] == 1


def test_more_collectives_answer_as_horovods(dropin):
    """Min, Max and Product (integers and float16 too, the gradient reduced with the same op),
    async handles polled and synchronized out of order, grouped forms, alltoall with and without
    splits (its gradient sent back), reducescatter (the first rank one row more; Horovod's
    gradients) and join (naming the rank that arrived last), as Horovod gives them (under
    Horovod these are its own functions: the same assertions hold for both)."""
    n = len(dropin)
    fact = math.factorial(n)
    s = n * (n - 1) // 2
    rows = [(2 * n + 1) // n + (j < (2 * n + 1) % n) for j in range(n)]
    base = [[2.0 * i, 2.0 * i + 1] for i in range(2 * n + 1)]
    for r in dropin:
        k = r["rank"]
        assert r["more_min_max_product"] == [[1.0, -n, 2.0], [float(n), -1.0, 2.0],
                                             [float(fact), float((-1) ** n * fact), 2.0 ** n]]
        assert r["more_int_max"] == [[n, 5], "torch.int32"]
        assert r["more_half_min"] == [[1.0, -n, 2.0], "torch.float16"]
        assert r["more_max_grad"] == [1.0, float(n + 1)]
        assert r["more_polled"]
        assert r["more_async"] == [[float(s)] * 3, [(n - 1) / 2] * 2, [(n - 1) / 2] * 2,
                                   [float(n - 1)] * 2,
                                   [[float(j)] * 2 for j in range(n) for _ in range(j + 1)]]
        assert r["more_grouped"] == [[float(s)] * 2, [2.0 * s] * 3]
        assert r["more_grouped_"] == [[(n - 1) / 2] * 2, [float(n - 1)] * 3]
        assert r["more_grouped_allgather"] == [[float(j) for j in range(n)],
                                               [1.0] * (n * (n + 1) // 2)]
        assert r["more_grouped_async"] == [[float(s)] * 2, [float(n)]]
        out, received, dtype, grad = r["more_alltoall"]
        assert out == [[100.0 * j + k] for j in range(n) for _ in range(k + 1)]
        assert received == [k + 1] * n and dtype == "torch.int32"
        assert grad == [float(j + 1) for j in range(n) for _ in range(j + 1)]
        assert r["more_alltoall_even"] == [10.0 * j + 2 * k + i for j in range(n) for i in (0, 1)]
        assert r["more_alltoall_uneven"] == "ValueError"
        assert r["more_alltoall_async"] == [[k + 10.0 * j for j in range(n)], [1] * n]
        lo = sum(rows[:k])
        mine = base[lo:lo + rows[k]]
        avg, grad, total, total_async = r["more_reducescatter"]
        assert avg == [[v * (n + 1) / 2 for v in row] for row in mine]
        assert grad == [[1.0 + 2 * i, 2.0 + 2 * i] for c in rows for i in range(c)]
        assert total == total_async == [[v * n * (n + 1) / 2 for v in row] for row in mine]
        assert r["more_reducescatter_sum_grad"] == [[3.0 * n] * 2] * (2 * n + 1)
        assert r["more_join"] is True
        assert r["more_queries"] == [True, True]
        # disagreeing ranks: the same clear error everywhere, then the job goes on
        assert r["more_mismatches"] == {k: ["HorovodInternalError", True] for k in
                                        ("shape", "op", "dtype", "root", "trailing")}, \
            r["more_mismatches"]
        assert r["more_after_mismatches"] == [float(n * (n + 1) // 2)]


def test_collectives_at_their_edges_answer_as_horovods(dropin):
    """A complex allreduce is refused in every form (hvd_sparse.mpi summed it as integers,
    dropping the imaginary part); a name in use by an unsynchronized operation is refused
    and free again after ``synchronize``; the grouped forms return Horovod's types; async
    collectives started in a different order on each rank come back under their own names
    (Horovod) or fail on every rank (MPI matches by call order: they were silently swapped)."""
    n = len(dropin)
    for r in dropin:
        assert r["names_complex_sync"] == r["names_complex_async"] == "ValueError"
        assert r["names_complex_grouped"] == "ValueError"
        # (Horovod refuses it while the first is still in its queue: a race it usually loses)
        assert r["names_duplicate"] == "ValueError" or r["names_backend"] == "horovod"
        assert r["names_reused"] == [float(1)] * 3
        assert r["names_types"] == {
            "grouped_allreduce": "list", "grouped_allreduce_": "tuple",
            "grouped_allreduce_async": "tuple", "grouped_allgather": "tuple",
            "grouped_allgather_async": "tuple", "grouped_reducescatter": "list",
            "grouped_reducescatter_async": "tuple"}
        assert r["names_order"] in ("HorovodInternalError", r["names_order_want"])
        assert r["names_after"] == [float(n)]
        assert r["names_mixed_forms"] == [float(n * (n + 1) / 2)] * 2
        if r["names_backend"] == "mpi":  # agreed before the dtype is refused: all ranks know
            assert r["names_retry"] == [float(n)] * 2
            assert r["names_dropped_handle"] == [0.0, 0.0]
            assert r["names_complex_one_rank"] == ["HorovodInternalError", True]
            assert r["names_after_complex"] == [float(n)]
    assert len({isinstance(r["names_order"], str) for r in dropin}) == 1  # all fail, or none


def test_mpi_sync_batch_norm_is_one_batch_norm_over_all_ranks(dropin):
    """hvd_sparse.mpi.SyncBatchNorm (ranks' batches of different sizes) against one
    BatchNorm1d over the batches put together: outputs, input gradients, summed parameter
    gradients and running statistics agree to float rounding, over two steps and in eval."""
    if "sbn_output" not in dropin[0]:
        pytest.skip("Horovod's own SyncBatchNorm needs CUDA: hvd_sparse.mpi's is tested")
    for r in dropin:
        assert r["sbn_output"] < 1e-5 and r["sbn_input_grad"] < 1e-5, r
        assert r["sbn_param_grad"] < 1e-5 and r["sbn_eval"] < 1e-5, r
        mean, var, tracked = r["sbn_running"]
        assert mean < 1e-6 and var < 1e-5 and tracked == 2


def test_mpi_broadcasts_in_chunks(dropin):
    """hvd_sparse.mpi's broadcast_, broadcast_object and allgather_object cut their bytes into
    chunks (MPI's int counts end at 2 GiB; one mpi4py bcast of AdamW's state over 268M
    parameters failed): with 5-byte chunks, every object and tensor arrives whole; the mpi4py
    transport's allreduce likewise sums in pieces of at most ALLREDUCE_CHUNK elements."""
    n = len(dropin)
    if "helpers_chunked_broadcast_" not in dropin[0]:
        pytest.skip("Horovod's own broadcasts: the chunking is hvd_sparse.mpi's")
    for r in dropin:
        assert r["helpers_chunked_broadcast_"] == [float(i * n) for i in range(37)]
        assert r["helpers_chunked_broadcast_object"] == [n - 1, [float(i * n) for i in range(11)]]
        assert r["helpers_chunked_allgather_object"] == [[i, 3 * i + 1] for i in range(n)]
        calls = r["helpers_chunked_broadcast_calls"]
        assert len(calls) > 37 * 4 // 5 and max(calls) == 5
        total = sum(range(1, n + 1))
        assert r["helpers_chunked_allreduce"] == [float(i * total) for i in range(10)]
        assert r["helpers_chunked_allreduce_avg"] == [i * total / n for i in range(10)]


def test_two_optimizers_stepped_in_a_rank_dependent_order(dropin):
    """As under Horovod, exchanged gradients train when ranks step two optimizers in
    different orders; where the optimizers' own collectives run in step() (exchanged updates,
    the time cost model's calibration) every rank raises an error that names the order
    instead of pairing one optimizer's figures with the other's."""
    for r in dropin:
        assert r["order_gradient_off_error"] is None and r["order_gradient_off_equal"]
        assert r["order_gradient_time_error"] == "ExchangeOrderError"
        # at the first exchange a model that differs looks the same: both causes are named
        assert r["order_update_error"] == "ConfigMismatchError"
        assert "same order on every rank" in r["order_update_message"]
