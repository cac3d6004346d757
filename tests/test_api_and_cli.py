"""The one-line switch (`import hvd_sparse as hvd`) and the training entry point end to end."""
import json
import subprocess
import sys

import pytest
import torch

import hvd_sparse
from conftest import ROOT, _env, launch_command
from hvd_sparse.transport import LocalTransport


def test_horovod_names_are_reexported(mpi_available):
    import horovod.torch as real

    for name in ("rank", "size", "local_rank", "allreduce", "allgather", "Compression", "Average",
                 "Sum", "elastic"):
        assert getattr(hvd_sparse, name) is getattr(real, name), name
    assert hvd_sparse.DistributedOptimizer is not real.DistributedOptimizer
    # join is Horovod's behind a check for sparse buckets (tests/test_horovod_parity.py)
    assert hvd_sparse.join is not real.join and "join" in hvd_sparse.__all__
    # init prepares Open MPI's idle yielding, then calls Horovod's with the same arguments
    # (test_core_sharing.py)
    assert hvd_sparse.init is not real.init and "init" in hvd_sparse.__all__
    # hvd_sparse's also carries the replicated state; it calls Horovod's for the rest
    assert hvd_sparse.broadcast_optimizer_state is not real.broadcast_optimizer_state
    # Horovod's for contiguous tensors, through a contiguous copy for others (channels_last)
    assert hvd_sparse.broadcast_parameters is not real.broadcast_parameters
    with pytest.raises(AttributeError):
        hvd_sparse.no_such_name


def test_wrapped_optimizer_is_still_the_users_class():
    m = torch.nn.Linear(4, 3)
    base = torch.optim.Adam(m.parameters(), lr=0.1)
    opt = hvd_sparse.DistributedOptimizer(base, named_parameters=m.named_parameters(),
                                          transport=LocalTransport())
    assert isinstance(opt, torch.optim.Adam)
    assert hvd_sparse.is_sparse_optimizer(opt) and not hvd_sparse.is_sparse_optimizer(base)
    assert opt.param_groups is base.param_groups
    with pytest.raises(TypeError, match="already"):
        hvd_sparse.DistributedOptimizer(opt, named_parameters=m.named_parameters(),
                                        transport=LocalTransport())
    with pytest.raises(ValueError, match="unique"):
        hvd_sparse.DistributedOptimizer(base, named_parameters=[("w", m.weight), ("w", m.bias)],
                                        transport=LocalTransport())
    with pytest.raises(ValueError, match="not named"):
        hvd_sparse.DistributedOptimizer(base, named_parameters=[("w", m.weight)],
                                        transport=LocalTransport())


ONE_PROCESS = r"""
import json, torch
import hvd_sparse as hvd
hvd.init()
torch.manual_seed(0)
m, ref = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
m.unused, ref.unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
ref.load_state_dict(m.state_dict())
opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.1),
                               named_parameters=m.named_parameters(), density=0.01,
                               min_sparse_numel=0)
base = torch.optim.SGD(ref.parameters(), lr=0.1, weight_decay=0.1)
out = {"size": hvd.size()}
for step in range(3):
    x = torch.randn(8, 64)
    for model, o in ((m, opt), (ref, base)):
        o.zero_grad()
        model(x).square().mean().backward()
        model(x).abs().mean().backward()  # two backward passes: Horovod's guard needs hooks
    opt.zero_grad()  # after backward, before step: allowed without hooks
    base.zero_grad()
    for model in (m, ref):
        model(x).square().mean().backward()
    opt.step()
    base.step()
out["equal"] = all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))
# a parameter with no gradient keeps none, and so no weight decay, as under Horovod
out["unused"] = [m.unused.grad is None, m.unused.tolist()]
# one already wrapped by Horovod (a half-migrated script): refused, where it was taken and
# recursed at the first zero_grad()
import horovod.torch
try:
    hvd.DistributedOptimizer(horovod.torch.DistributedOptimizer(
        torch.optim.SGD(ref.parameters(), lr=0.1), named_parameters=ref.named_parameters()),
        named_parameters=ref.named_parameters())
except TypeError as e:
    out["horovods_refused"] = "horovod.torch.DistributedOptimizer" in str(e)
print(json.dumps(out))
"""


def test_one_process_under_horovod_is_the_wrapped_optimizer(mpi_available):
    """As Horovod's: at size 1 (not elastic) no hooks, hence no guards, and the step is the
    wrapped optimizer's own (an average over one rank): a parameter without a gradient keeps
    none (it was given a zero one, and weight decay moved it). One wrapped by Horovod already
    is refused with a TypeError that says so."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", ONE_PROCESS], env=_env(), capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"size": 1, "equal": True, "unused": [True, [1.0, 1.0, 1.0]],
                   "horovods_refused": True}


RESUMED_ALONE = r"""
import copy, json, torch
import hvd_sparse as hvd
from hvd_sparse.transport import LocalTransport
hvd.init()
out = {"size": hvd.size()}
for name, make, kw in (("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1), {}),
                       ("adam", lambda ps: torch.optim.Adam(ps, lr=0.01), {"exchange": "update"})):
    torch.manual_seed(0)
    m = torch.nn.Linear(32, 8)
    # a state with pending mass in both residuals, as a larger job's checkpoint holds
    src = hvd.DistributedOptimizer(make(m.parameters()), named_parameters=m.named_parameters(),
                                   density=0.1, min_sparse_numel=0, cost_model="off",
                                   transport=LocalTransport(), **kw)
    for step in range(4):
        src.zero_grad()
        m(torch.randn(8, 32)).square().mean().backward()
        src.step()
    sd = src.state_dict()
    buckets = sd["hvd_sparse"]["buckets"]
    pending = {n: sum(buckets[n][k].double() for k in ("uplink", "downlink")
                      if buckets[n][k] is not None) for n in ("weight", "bias")}
    ref = torch.nn.Linear(32, 8)
    ref.load_state_dict(m.state_dict())
    opt = hvd.DistributedOptimizer(make(m.parameters()), named_parameters=m.named_parameters(),
                                   density=0.1, min_sparse_numel=0, **kw)
    opt.load_state_dict(copy.deepcopy(sd))  # (torch's load may share the state's tensors)
    base = make(ref.parameters())
    base.load_state_dict(copy.deepcopy({k: v for k, v in sd.items() if k != "hvd_sparse"}))
    x = torch.randn(8, 32)
    for model, o in ((m, opt), (ref, base)):
        o.zero_grad()
        model(x).square().mean().backward()
    if name == "sgd":  # gradient mass: joins the gradient of the first step
        for n, p in ref.named_parameters():
            p.grad += pending[n].view_as(p).float()
    opt.step()
    base.step()
    if name == "adam":  # weight changes: join the parameters after it
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p += pending[n].view_as(p).float()
    later = opt.state_dict()["hvd_sparse"]
    out[name] = {
        "pending": all(bool(v.any()) for v in pending.values()),
        "applied": all(torch.allclose(a, b, atol=1e-6) for a, b in
                       zip(m.parameters(), ref.parameters())),
        "emptied": all(v["uplink"] is None and v["downlink"] is None
                       for v in later["buckets"].values()),
        "steps": [sd["hvd_sparse"]["steps"], later["steps"]]}
print(json.dumps(out))
"""


@pytest.mark.usefixtures("one_bucket_per_tensor")
def test_one_process_under_horovod_applies_a_loaded_states_pending_mass(mpi_available):
    """A larger job's state resumed by one process under Horovod (where the wrapped optimizer
    steps alone): the residuals' mass joins the first step once (gradient mass in the gradient,
    weight changes in the parameters), is not saved again, and the exchange counter moves on
    (a peer's probe: the mass sat unused, was carried into the next checkpoint and replayed,
    stale, at a resume on two ranks)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", RESUMED_ALONE], env=_env(),
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["size"] == 1
    for name in ("sgd", "adam"):
        assert out[name]["pending"] and out[name]["applied"] and out[name]["emptied"], out
        assert out[name]["steps"] == [4, 5], out


@pytest.mark.parametrize("argv", [["--momentum-masking", "2"],
                                  ["--sparsifier", "threshold", "--threshold", "-1"]])
def test_training_cli_refuses_an_option_the_library_refuses_in_one_line(argv, mpi_available):
    """Values only the optimizer checks end the run with its message, no traceback."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "hvd_sparse.train", "--epochs", "1",
                           "--train-limit", "256", "--test-limit", "100", "--no-progress",
                           *argv], env=_env(), capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("hvd_sparse.train: "), proc.stderr
    assert argv[-2].lstrip("-").replace("-", "_") in proc.stderr


@pytest.mark.multirank
def test_training_cli_two_ranks_end_to_end(tmp_path, mpi_available):
    import subprocess

    metrics = tmp_path / "metrics.jsonl"
    # gradients exchanged: in a 32-step run the CLI's SGD default (updates, README) has not
    # yet caught up (test accuracy 0.19 and 0.49 on two seeds, against 0.49 and 0.56)
    cmd = launch_command("horovodrun", 2, "-m", "hvd_sparse.train", "--epochs", "2",
                         "--train-limit", "2048", "--test-limit", "1000",
                         "--metrics", metrics, "--no-progress", "--cost-model", "off",
                         "--exchange", "gradient")
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in recs] == [1, 2]
    last = recs[-1]
    assert last["ranks"] == 2 and last["steps"] == 2 * (1024 // 64)
    assert 0.3 < last["test_accuracy"] <= 1.0  # well above chance (0.1) after 32 steps
    assert last["bytes_sent"] * 10 < last["dense_bytes"]
    assert 0.009 < last["achieved_density"] < 0.02


def test_training_cli_relaunches_under_mpirun_for_transport_mpi(tmp_path, mpi4py_available):
    """``--ranks 2 --transport mpi`` starts mpirun (no horovodrun), the dense control runs
    there (hvd_sparse at density 1: no Horovod initialised), and benchmark steps past one
    epoch take the next epoch's batches (they were empty, their loss NaN)."""
    import math
    import subprocess
    import sys

    metrics = tmp_path / "bench.jsonl"
    cmd = [sys.executable, "-m", "hvd_sparse.train", "--ranks", "2", "--transport", "mpi",
           "--optimizer", "dense", "--train-limit", "512", "--test-limit", "200",
           "--benchmark-steps", "8", "--metrics", str(metrics), "--no-progress"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (rec,) = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert rec["ranks"] == 2 and rec["steps"] == 8  # 4 steps per epoch: two epochs' worth
    assert len(rec["loss_all"]) == 8 and all(math.isfinite(x) for x in rec["loss_all"])


def test_single_process_training_with_local_transport():
    """One rank, no Horovod: the optimizer still sparsifies with error feedback and converges."""
    torch.manual_seed(0)
    x = torch.randn(256, 20)
    w_true = torch.randn(20, 1)
    y = x @ w_true
    m = torch.nn.Linear(20, 1, bias=False)
    opt = hvd_sparse.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                          named_parameters=m.named_parameters(), density=0.1,
                                          min_sparse_numel=0, transport=LocalTransport())
    first = None
    for _ in range(300):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
        assert opt.communication_stats()["selected"] == 2  # ceil(0.1 * 20)
    assert loss.item() < 1e-3 * first


def test_fp16_compression_rounding_stays_in_the_residual():
    """compression=Compression.fp16: fp16 values on the wire, the rounding error kept locally."""
    from hvd_sparse.compat import Compression

    m = torch.nn.Linear(64, 32, bias=False)
    opt = hvd_sparse.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0),
                                          named_parameters=m.named_parameters(), density=0.25,
                                          bidirectional=False, compression=Compression.fp16,
                                          transport=LocalTransport())
    torch.manual_seed(1)
    m(torch.randn(8, 64)).pow(2).sum().backward()
    raw = m.weight.grad.detach().clone().reshape(-1)
    opt.step()
    applied = m.weight.grad.detach().reshape(-1)
    residual = list(opt.engine_state().values())[0].uplink
    sent = applied != 0
    assert int(sent.sum()) == 512  # ceil(0.25 * 2048)
    assert torch.equal(applied[sent], raw[sent].half().float())  # values went as fp16
    assert torch.equal(applied + residual, raw)  # nothing lost, bit for bit
    stats = opt.communication_stats()
    assert stats["bytes_sent"] == 16 + 512 * 4 + 512 * 2  # header, int32 indices, fp16 values


@pytest.mark.usefixtures("one_bucket_per_tensor")
def test_engine_state_is_a_read_only_snapshot_and_cost_model_is_validated():
    m = torch.nn.Linear(64, 32)
    opt = hvd_sparse.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                          named_parameters=m.named_parameters(), density=0.1,
                                          min_sparse_numel=0, transport=LocalTransport())
    m(torch.randn(8, 64)).pow(2).sum().backward()
    opt.step()
    view = opt.engine_state()
    assert list(view) == ["weight", "bias"]
    w = view["weight"]
    assert w.numel == 64 * 32 and w.sparse and w.mode == "sparse"
    assert w.uplink is not None and w.downlink is not None
    w.uplink.fill_(123.0)  # a copy: the engine's residual does not change
    assert not torch.equal(opt.engine_state()["weight"].uplink, w.uplink)
    with pytest.raises(TypeError):
        view["weight"] = None  # the mapping itself is read-only
    stats = opt.communication_stats()
    assert set(stats["stage_seconds"]) >= {"uplink_select", "downlink_select", "write"}
    assert stats["cost_model"]["rule"] == "time"
    with pytest.raises(ValueError, match="cost_model"):
        hvd_sparse.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                        named_parameters=m.named_parameters(),
                                        cost_model="fast", transport=LocalTransport())


@pytest.mark.multirank
def test_training_cli_transformer_adamw_update_exchange(tmp_path, mpi_available):
    """The language-model workload end to end: char Transformer, AdamW with warm-up and
    cosine decay, updates exchanged; rank 0 prints progress lines under a launcher."""
    import subprocess

    metrics = tmp_path / "metrics.jsonl"
    cmd = launch_command("mpirun", 2, "-m", "hvd_sparse.train", "--dataset", "shakespeare",
                         "--model", "transformer", "--base-optimizer", "adamw", "--lr", "3e-3",
                         "--warmup-steps", "4", "--batch-size", "4", "--seq-len", "32",
                         "--epochs", "2", "--steps-per-epoch", "10", "--exchange", "update",
                         "--cost-model", "off", "--metrics", metrics)
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in recs] == [1, 2] and recs[-1]["steps"] == 20
    assert recs[-1]["valid_loss"] < recs[0]["valid_loss"] < 5.0  # it learns
    assert recs[-1]["bytes_sent"] * 10 < recs[-1]["dense_bytes"]
    assert "epoch 1/2: step 10/10" in proc.stdout  # progress without a terminal
    assert recs[-1]["bidirectional"] is False  # the CLI's default for adaptive updates


@pytest.mark.parametrize("base, exchange, given, want", [
    # (exchange, bidirectional, density warm-up steps) the CLI settles on
    ("adamw", "auto", {}, ("auto", False, 30)),  # the study's best setting, 10% of 300 steps
    ("adamw", "update", {}, ("update", False, 30)),
    ("adamw", "gradient", {}, ("gradient", True, 0)),  # gradients: the library's defaults
    ("sgd", "auto", {}, ("update", False, 30)),  # updates, no downlink selection, the warm-up
    ("sgd", "update", {}, ("update", False, 30)),
    ("sgd", "gradient", {}, ("gradient", True, 0)),
    # SGD with a gradient lever keeps gradients
    ("sgd", "auto", {"momentum_correction": True}, ("gradient", True, 0)),
    ("sgd", "auto", {"density_cooldown_steps": 30}, ("update", False, 30)),
    ("adamw", "auto", {"bidirectional": True, "density_warmup_steps": 0}, ("auto", True, 0)),
    ("adamw", "auto", {"density_warmup_steps": 7}, ("auto", False, 7)),
    ("sgd", "auto", {"bidirectional": False, "density_warmup_steps": 0}, ("update", False, 0)),
    ("sgd", "auto", {"bidirectional": True}, ("update", True, 30)),
])
def test_cli_exchange_defaults(base, exchange, given, want):
    from hvd_sparse.train.__main__ import exchange_defaults, parse_args

    argv = ["--base-optimizer", base, "--exchange", exchange]
    if "bidirectional" in given:
        argv.append("--bidirectional" if given["bidirectional"] else "--no-bidirectional")
    for flag in ("density_warmup_steps", "density_cooldown_steps"):
        if flag in given:
            argv += ["--" + flag.replace("_", "-"), str(given[flag])]
    if given.get("momentum_correction"):
        argv.append("--momentum-correction")
    args = parse_args(argv)
    args.total_steps = 300
    params = [torch.nn.Parameter(torch.zeros(3))]
    opt = torch.optim.AdamW(params) if base == "adamw" else torch.optim.SGD(params, lr=0.1)
    exchange_defaults(args, opt)
    assert (args.exchange, args.bidirectional, args.density_warmup_steps) == want


@pytest.mark.parametrize("argv, want", [
    # (exchange, momentum masking's strength, cool-down steps) for SGD with momentum, 300 steps
    ([], ("update", 0.5, 30)),  # updates, half the momentum masked, and the cool-down
    (["--density-cooldown-steps", "0"], ("update", 0.5, 0)),
    (["--no-momentum-masking"], ("update", 0.0, 30)),
    (["--momentum-masking"], ("update", 1.0, 30)),  # DGC's: zeroed where sent
    (["--momentum-masking", "0.25"], ("update", 0.25, 30)),
    (["--density-cooldown-steps", "12"], ("update", 0.5, 12)),
    (["--exchange", "gradient"], ("gradient", 0.0, 0)),
    (["--momentum-correction"], ("gradient", 0.0, 0)),
    # the hard threshold's absolute threshold is chosen from gradients
    (["--sparsifier", "threshold"], ("gradient", 0.0, 0)),
])
def test_cli_sgd_exchanges_updates_masks_and_cools_down(argv, want):
    from hvd_sparse.train.__main__ import exchange_defaults, parse_args

    args = parse_args(argv)
    args.total_steps = 300
    params = [torch.nn.Parameter(torch.zeros(3))]
    exchange_defaults(args, torch.optim.SGD(params, lr=0.1, momentum=0.9))
    assert (args.exchange, args.momentum_masking, args.density_cooldown_steps) == want


def test_cli_adamw_and_momentum_correction_neither_mask_nor_cool_down():
    from hvd_sparse.train.__main__ import exchange_defaults, parse_args

    params = [torch.nn.Parameter(torch.zeros(3))]
    for argv, base in ((["--base-optimizer", "adamw"], torch.optim.AdamW(params)),
                       (["--momentum-correction"], torch.optim.SGD(params, lr=0.1))):
        args = parse_args(argv)
        args.total_steps = 300
        exchange_defaults(args, base)
        assert (args.momentum_masking, args.density_cooldown_steps) == (False, 0)


def test_cli_dense_and_local_runs_keep_auto():
    """The exchange defaults are the sparse optimizer's: a dense or local run is left as given."""
    from hvd_sparse.train.__main__ import exchange_defaults, parse_args

    for optimizer in ("dense", "local"):
        args = parse_args(["--optimizer", optimizer])
        args.total_steps = 300
        exchange_defaults(args, torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1))
        assert (args.exchange, args.bidirectional, args.density_warmup_steps) == \
            ("auto", True, 0)


def test_cli_local_steps_exchange_once_every_so_many_steps():
    """--local-steps N: the optimizer the CLI builds exchanges once every N steps."""
    from hvd_sparse.train.__main__ import build_optimizer, exchange_defaults, parse_args

    exchanges = {}
    for local in (1, 3):
        args = parse_args(["--local-steps", str(local), "--cost-model", "off"])
        args.total_steps = 100
        torch.manual_seed(0)
        m = torch.nn.Linear(8, 4)
        base = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        exchange_defaults(args, base)
        args.transport = LocalTransport()
        opt = build_optimizer(args, m, base, hvd_sparse)
        for _ in range(6):
            opt.zero_grad()
            m(torch.randn(2, 8)).sum().backward()
            opt.step()
        exchanges[local] = opt.communication_stats()["steps"]
    assert exchanges == {1: 6, 3: 2}


@pytest.mark.parametrize("base,given,cosine", [
    ("sgd", "auto", False), ("sgd", "cosine", True), ("sgd", "constant", False),
    ("adamw", "auto", True), ("adamw", "constant", False)])
def test_cli_lr_schedule(base, given, cosine):
    """--lr-schedule: cosine decays the rate to zero at the run's end (after the warm-up),
    constant leaves it; auto is cosine for AdamW only."""
    from hvd_sparse.train.__main__ import lr_schedule, parse_args

    args = parse_args(["--base-optimizer", base, "--lr-schedule", given, "--warmup-steps", "2"])
    args.total_steps = 10
    params = [torch.nn.Parameter(torch.zeros(3))]
    opt = torch.optim.AdamW(params, lr=0.1) if base == "adamw" else \
        torch.optim.SGD(params, lr=0.1)
    sched = lr_schedule(args, opt)
    assert (sched is not None) == cosine
    rates = []
    for _ in range(10):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched is not None:
            sched.step()
    if cosine:
        assert rates[0] < rates[1] == pytest.approx(0.1) and rates[-1] < 0.01
        assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    else:
        assert rates == [0.1] * 10


def test_progress_lines_every_five_percent():
    from hvd_sparse.train.__main__ import _progress_due

    due = [s for s in range(200) if _progress_due(s, 200)]
    assert due == list(range(9, 200, 10))
    assert [s for s in range(7) if _progress_due(s, 7)] == list(range(7))


@pytest.mark.parametrize("argv, want", [
    ([], ("cnn", 64, 0.05)),
    (["--dataset", "shakespeare"], ("lstm", 32, 0.5)),
    (["--dataset", "fortunes", "--model", "gru"], ("gru", 32, 0.3)),
    (["--dataset", "shakespeare", "--base-optimizer", "adamw"], ("lstm", 32, 3e-3)),
    (["--base-optimizer", "adamw", "--model", "resnet"], ("resnet", 64, 3e-3)),
    (["--dataset", "fortunes", "--model", "gru", "--lr", "0.7", "--batch-size", "8"],
     ("gru", 8, 0.7)),
])
def test_cli_workload_defaults(argv, want):
    """The model, batch and rate where not given: AdamW never inherits an SGD rate."""
    from hvd_sparse.train.__main__ import parse_args, workload_defaults

    args = parse_args(argv)
    workload_defaults(args)
    assert (args.model, args.batch_size, args.lr) == want


@pytest.mark.parametrize("density, want", [(0.01, 30), (0.05, 30), (0.001, 15), (0.0099, 15)])
def test_cli_warmup_is_shorter_below_one_percent(density, want):
    """At 0.1% a 10% warm-up alone would send about 3% of dense's bytes: half as long there."""
    from hvd_sparse.train.__main__ import exchange_defaults, parse_args

    args = parse_args(["--density", str(density)])
    args.total_steps = 300
    exchange_defaults(args, torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1,
                                            momentum=0.9))
    assert args.density_warmup_steps == want


@pytest.mark.parametrize("argv, want", [
    (["--density", "0.01"], "tensor"), (["--density", "0.05"], "tensor"),
    (["--density", "0.001"], "model"), (["--density", "0.0099"], "model"),
    (["--density", "0.001", "--base-optimizer", "adamw"], "model"),
    (["--density", "0.001", "--scope", "tensor"], "tensor"),  # overridable
    (["--density", "0.01", "--scope", "bucket"], "bucket"),
    (["--density", "0.001", "--optimizer", "dense"], "tensor"),
    (["--density", "0.001", "--sparsifier", "sbc"], "tensor"),  # Top-K's rule only
])
def test_cli_selects_over_the_whole_model_below_one_percent(argv, want):
    """Below 1% one global Top-K: a layer-wise one leaves each tensor too few entries."""
    from hvd_sparse.train.__main__ import exchange_defaults, parse_args

    args = parse_args(argv)
    args.total_steps = 300
    params = [torch.nn.Parameter(torch.zeros(3))]
    base = torch.optim.AdamW(params) if "adamw" in argv else \
        torch.optim.SGD(params, lr=0.1, momentum=0.9)
    exchange_defaults(args, base)
    assert args.scope == want


@pytest.mark.usefixtures("one_bucket_per_tensor")
def test_library_scope_auto_is_global_for_topk_below_one_percent():
    """``scope="auto"`` (the default): one bucket for all large tensors for Top-K below 1%,
    one per tensor from 1% up and for other sparsifiers; a named scope is kept."""
    from hvd_sparse.buckets import resolve_scope
    from hvd_sparse.transport import LocalTransport

    assert resolve_scope("auto", 0.001, "topk") == "model"
    assert resolve_scope("auto", 0.01, "topk") == "tensor"
    assert resolve_scope("auto", 0.001, "gaussiank") == "tensor"
    assert resolve_scope("tensor", 0.001, "topk") == "tensor"
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    def sparse(**kw):
        opt = hvd_sparse.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
            transport=LocalTransport(), **kw)
        return [len(b.parameters) for b in opt.engine_state().values() if b.sparse]

    assert sparse(density=0.001) == [2]
    assert sparse(density=0.01) == [1, 1]
    assert sparse(density=0.001, scope="tensor") == [1, 1]
    assert sparse(density=0.001, sparsifier="gaussiank") == [1, 1]
    # Top-K named in any case or given as an instance chooses the same
    assert sparse(density=0.001, sparsifier="TopK") == [2]
    assert sparse(density=0.001, sparsifier=hvd_sparse.TopK()) == [2]
    # a checkpoint made per tensor (the default before) loads, its residuals moved parameter
    # by parameter into the one global bucket (they had been dropped, with a warning)
    def wrapped(**kw):
        return hvd_sparse.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
            transport=LocalTransport(), density=0.001, **kw)

    before = wrapped(scope="tensor")
    m(torch.randn(2, 64)).sum().backward()
    before.step()
    import warnings
    saved = before.state_dict()["hvd_sparse"]["buckets"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        after = wrapped()
        after.load_state_dict(before.state_dict())
        wrapped(scope="tensor").load_state_dict(before.state_dict())
    (whole,) = after.state_dict()["hvd_sparse"]["buckets"].values()
    assert torch.equal(whole["uplink"], torch.cat([saved["0.weight"]["uplink"],
                                                   saved["1.weight"]["uplink"]]))
    assert bool(whole["uplink"].any())


def test_mpi_front_end_refuses_another_launcher_and_takes_horovods_arguments(mpi4py_available):
    """A peer's probe of ``hvd_sparse.mpi``: started by horovodrun --gloo or torchrun, each
    process saw an MPI world of one and trained alone, silently; a numpy root (np.argmax) was
    refused as "not a rank"; process_set=global_process_set in DistributedOptimizer failed
    with a message about transport=; global_process_set.ranks was None; local_rank()
    answered before init(); hvd.elastic was a bare AttributeError."""
    import subprocess
    import sys as _sys

    from conftest import ROOT, _env

    script = (
        "import numpy as np, torch\n"
        "import hvd_sparse.mpi as hvd\n"
        "hvd.init()\n"
        "assert hvd.global_process_set.ranks == [0]\n"
        "assert hvd.broadcast_object('x', root_rank=np.int64(0)) == 'x'\n"
        "assert hvd.broadcast(torch.ones(2), root_rank=torch.tensor(0)).tolist() == [1.0, 1.0]\n"
        "m = torch.nn.Linear(4, 2)\n"
        "opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),\n"
        "    named_parameters=m.named_parameters(), process_set=hvd.global_process_set)\n"
        "assert hvd.local_rank() == 0\n"
        "try:\n"
        "    hvd.elastic\n"
        "    raise SystemExit('elastic?')\n"
        "except AttributeError as e:\n"
        "    assert 'import hvd_sparse as hvd' in str(e)\n"
        "hvd.shutdown()\n"
        "try:\n"
        "    hvd.local_rank()\n"
        "    raise SystemExit('local_rank before init answered')\n"
        "except ValueError:\n"
        "    pass\n"
        "print('ok')\n")
    run = subprocess.run([_sys.executable, "-c", script], env=_env(), capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]
    for var, launcher in (("HOROVOD_SIZE", "horovodrun"), ("WORLD_SIZE", "torchrun")):
        env = dict(_env(), **{var: "2"})
        run = subprocess.run([_sys.executable, "-c", "import hvd_sparse.mpi as hvd; hvd.init()"],
                             env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert run.returncode != 0 and launcher in run.stderr and "mpirun" in run.stderr, \
            run.stderr[-2000:]


@pytest.mark.parametrize("argv,says", [
    (["--model", "foo"], "--model foo does not fit --dataset fashion-mnist"),
    (["--dataset", "shakespeare", "--model", "cnn"], "does not fit --dataset shakespeare"),
    (["--density", "0"], "--density must be in (0, 1]"),
    (["--downlink-density", "2"], "--downlink-density must be in (0, 1]"),
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--batch-size", "-4"], "--batch-size must be at least 1"),
    (["--dataset", "shakespeare", "--steps-per-epoch", "0"], "--steps-per-epoch must be at least 1"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--local-steps", "0"], "--local-steps must be at least 1"),
    (["--local-steps", "2", "--optimizer", "dense"], "--local-steps applies to --optimizer sparse"),
    (["--local-steps", "2", "--momentum-correction"], "exchanges weight changes"),
    (["--local-steps", "2", "--sparsifier", "threshold"], "exchanges weight changes"),
    (["--ranks", "-1"], "--ranks must be at least 0"),
    (["--lr", "-1"], "--lr must be at least 0"),
    (["--metrics", "/nonexistent-folder/m.jsonl"], "--metrics: the folder"),
])
def test_training_cli_refuses_values_no_run_can_use_in_one_line(argv, says):
    """Before any data is read or rank started: argparse's usage and one error line, exit 2
    (they ended in tracebacks from deep inside a run, or trained nothing and exited 0)."""
    proc = subprocess.run([sys.executable, "-m", "hvd_sparse.train", *argv], env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in proc.stderr and "Traceback" not in proc.stderr


def test_training_cli_with_no_full_batch_says_so(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hvd_sparse.train", "--optimizer", "local",
                           "--train-limit", "10", "--epochs", "1", "--no-progress"],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "no full batch of 64 per rank" in proc.stderr and "Traceback" not in proc.stderr


def test_training_cli_progress_lines_stay_whole_under_tagged_output(tmp_path, mpi4py_available):
    """Launchers run Python unbuffered (horovodrun sets PYTHONUNBUFFERED) and tag each chunk
    of output: print's text and its newline went out apart, and every progress line of the
    README's main job ended in a stray "[1,0]<stdout>:". One write per line now."""
    cmd = launch_command("mpirun", 2, "-m", "hvd_sparse.train", "--transport", "mpi",
                         "--epochs", "1", "--train-limit", "1280", "--test-limit", "200",
                         "--cost-model", "off")
    cmd.insert(1, "--tag-output")
    env = dict(_env(), PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tagged = [line for line in proc.stdout.splitlines() if "<stdout>:" in line]
    assert any("step 10/10" in line for line in tagged), proc.stdout[-2000:]
    assert all(line.count("<stdout>:") == 1 for line in tagged), proc.stdout[-2000:]


def test_training_cli_takes_the_data_folder_it_was_given(tmp_path):
    """FASHION_MNIST_DIR names the copy to use: a folder without it is a one-line error, where
    the system's copy was taken silently."""
    env = dict(_env(), FASHION_MNIST_DIR=str(tmp_path / "nowhere"))
    proc = subprocess.run([sys.executable, "-m", "hvd_sparse.train", "--optimizer", "local",
                           "--epochs", "1", "--train-limit", "640", "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "nowhere" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_training_cli_benchmark_mode_reads_neither_epochs_nor_full_batches(tmp_path):
    """--benchmark-steps times steps on whatever batches there are (partial ones included)
    and never reads --epochs: the checks for a training run do not refuse it."""
    proc = subprocess.run([sys.executable, "-m", "hvd_sparse.train", "--optimizer", "local",
                           "--train-limit", "32", "--test-limit", "64", "--epochs", "0",
                           "--benchmark-steps", "3"],
                          env=_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["model"] == "cnn"


AFTER_SHUTDOWN = r"""
import json, torch, hvd_sparse as hvd
hvd.init()
torch.manual_seed(0)
m = torch.nn.Linear(50, 40)
opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                               named_parameters=m.named_parameters(), min_sparse_numel=0,
                               density=0.05)
for i in range(2):
    opt.zero_grad(); m(torch.randn(4, 50)).sum().backward(); opt.step()
rank = hvd.rank()
hvd.shutdown()  # (no state_dict() before it: nothing asked the world for the checkpoint)
out = {"rank": rank}
sd = opt.state_dict()["hvd_sparse"]
out["saved"] = [sd["world_size"], sd["rank"], sd["steps"] == 2,
                all(b["uplink"] is not None and bool(torch.isfinite(b["uplink"]).all())
                    for b in sd["buckets"].values())]
out["view"] = len(opt.engine_state())
try:
    opt.zero_grad(); m(torch.randn(4, 50)).sum().backward(); opt.step()
    out["step"] = "no error"
except Exception as e:
    out["step"] = type(e).__name__
print(json.dumps(out))
"""


@pytest.mark.usefixtures("one_bucket_per_tensor")
@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [2, 1])
def test_a_checkpoint_can_be_taken_after_shutdown(mpi_available, ranks):
    """A script that shuts Horovod down, then saves: ``state_dict()`` and ``engine_state()``
    answer with the world the job had (they raised Horovod's 'not been initialized', where
    Horovod's own optimizer saves), and a step after it still fails clearly. One process
    too: there the rank had never been asked before the shutdown."""
    import subprocess

    cmd = launch_command("mpirun", 2, "-c", AFTER_SHUTDOWN) if ranks == 2 else \
        [sys.executable, "-c", AFTER_SHUTDOWN]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=180,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import re

    # (the ranks' lines may run together in mpirun's output: each object is flat)
    outs = sorted((json.loads(o) for o in re.findall(r'\{"rank".*?\}', proc.stdout)),
                  key=lambda o: o["rank"])
    assert [o["rank"] for o in outs] == list(range(ranks))
    for o in outs:
        # (one process exchanges nothing: no residuals to keep)
        assert o["saved"] == [ranks, o["rank"], True, ranks > 1], o
        assert o["view"] == 2  # a bucket per tensor (weight, bias)
        assert o["step"] != "no error", o  # Horovod's ValueError or HorovodInternalError


def test_horovods_elastic_imports_work_under_hvd_sparses_name(mpi_available):
    """``from horovod.torch.elastic import TorchState, run`` with ``horovod.torch`` replaced
    by ``hvd_sparse``, as Horovod's elastic examples import them: a missing module before."""
    import horovod.torch.elastic as theirs

    from hvd_sparse.elastic import ElasticSampler, TorchState, run  # noqa: F401

    import hvd_sparse.elastic as ours

    assert TorchState is theirs.TorchState and run is theirs.run
    assert ours.state is theirs.state and ours._reset is theirs._reset
    assert hvd_sparse.elastic.ElasticSampler is theirs.ElasticSampler


def test_broadcast_parameters_refuses_what_is_no_collection_as_horovod(mpi_available):
    """``broadcast_parameters(5, 0)``: Horovod's ValueError (was a TypeError, 'int' object is
    not iterable), from the Horovod-backed and the mpi4py front end alike, before any
    collective (one process here)."""
    import subprocess

    script = (
        "import torch, hvd_sparse, hvd_sparse.mpi as hm\n"
        "hvd_sparse.init(); hm.init()\n"
        "for f in (hvd_sparse.broadcast_parameters, hm.broadcast_parameters):\n"
        "    try:\n"
        "        f(5, 0)\n"
        "        raise SystemExit('accepted')\n"
        "    except ValueError as e:\n"
        "        assert 'invalid params' in str(e), e\n"
        "    f(iter([torch.ones(2)]), 0)  # any other iterable is taken as a list, as before\n"
        "print('ok')\n")
    run = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


HELP_RUNNER = r"""
import contextlib, io, json, runpy, sys
from pathlib import Path
bench = Path(sys.argv[1])
sys.path.insert(0, str(bench))
out = {}
for script in sorted(bench.glob("*.py")):
    if script.name == "common.py":
        continue
    sys.argv = [str(script), "--help"]
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            runpy.run_path(str(script), run_name="__main__")
        out[script.name] = ["no exit", text.getvalue()[:200]]
    except SystemExit as e:
        out[script.name] = [e.code, text.getvalue()[:200]]
    except BaseException as e:
        out[script.name] = [repr(e), text.getvalue()[:200]]
print(json.dumps(out))
"""


def test_every_benchmark_answers_help_and_runs_nothing():
    """``--help`` on each script in benchmarks/ prints its usage and exits 0, with nothing
    measured and no result written (one ran its whole simulation and overwrote its committed
    results; another failed on a missing argument)."""
    results = ROOT / "benchmarks" / "results"
    before = {p: p.stat().st_mtime_ns for p in results.rglob("*") if p.is_file()}
    proc = subprocess.run([sys.executable, "-c", HELP_RUNNER, str(ROOT / "benchmarks")],
                          capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(answers) >= 20, answers.keys()
    for name, (code, text) in answers.items():
        assert code in (0, None) and text.startswith("usage:"), (name, code, text)
    after = {p: p.stat().st_mtime_ns for p in results.rglob("*") if p.is_file()}
    assert after == before
