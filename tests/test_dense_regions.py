"""Dense buckets summed by regions from 3 ranks (``hvd_sparse.engine.dense_regions``), in one
process: a peer world whose every rank sends what this one sends (the average is then this
rank's own gradient, whatever the path). Real multi-rank runs: tests/test_multirank.py and
tests/test_torch_transport.py."""
import pytest
import torch

import hvd_sparse
from hvd_sparse import costmodel
from hvd_sparse.engine import dense_regions
from hvd_sparse.transport import Transport


class _EchoWorld(Transport):
    """``size`` ranks, rank 0 here, every other one sending what this one sends."""

    def __init__(self, size=4, wire=torch.float32):
        self._size = size
        self.wire = wire
        self.alltoalls = 0
        self.sent = {}  # all-to-all payloads by name

    def size(self):
        return self._size

    def rank(self):
        return 0

    def allgather_async(self, payload, name):
        if not name.endswith(".sum"):
            return torch.cat([payload.reshape(-1)] * self._size)
        # the region sums: rank r's is region r of P equal vectors added in rank order
        full = self.sent.pop(name[:-len(".sum")]).view(self.wire)
        edges = dense_regions.edges(full.numel(), self._size)
        sums = [payload.reshape(-1)]
        for r in range(1, self._size):
            v = full[edges[r]:edges[r + 1]].to(payload.dtype)
            s = v + v
            for _ in range(2, self._size):
                s.add_(v)
            sums.append(s.mul_(1.0 / self._size))
        return torch.cat(sums)

    def allreduce_async(self, tensor, name, *, average, prescale=1.0, postscale=1.0):
        return tensor.mul_((1.0 if average else self._size) * prescale * postscale)

    def alltoall_async(self, payload, splits, name):
        self.alltoalls += 1
        self.sent[name] = payload.clone()
        return torch.cat([payload[:splits[0]]] * self._size)  # region 0 from every rank

    def wait(self, handle):
        return handle


class _NoAlltoall(_EchoWorld):
    alltoall_async = Transport.alltoall_async


def _run(transport, monkeypatch, regions=True, steps=3, dtype=torch.float32, **options):
    if not regions:
        monkeypatch.setattr(dense_regions, "REGIONS_FROM_BYTES", 1 << 62)
    torch.manual_seed(0)
    # (each above 2**17 entries: a bucket of its own in every dtype, of 256 KiB or more)
    named = [("w", torch.nn.Parameter(torch.randn(400, 401, dtype=dtype))),
             ("v", torch.nn.Parameter(torch.randn(140_000, dtype=dtype)))]
    params = [p for _, p in named]
    options.setdefault("exchange", "gradient")  # SGD's gradients: regions sum them
    opt = hvd_sparse.DistributedOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9),
                                          named_parameters=named, check_config=False,
                                          transport=transport, **options)
    gen = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(steps):
        opt.zero_grad()
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        expected = [p.grad.clone() for p in params]
        opt.synchronize()
        grads.append([(p.grad.clone(), e) for p, e in zip(params, expected)])
        with opt.skip_synchronize():
            opt.step()
    return params, grads, opt.communication_stats()["totals"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_regions_give_the_gathers_bits_in_fewer_bytes(dtype, monkeypatch):
    world = _EchoWorld(wire=dtype)
    params, grads, stats = _run(world, monkeypatch, dense_warmup_steps=10, dtype=dtype)
    assert world.alltoalls == 6  # two buckets, three steps
    for step in grads:
        for got, own in step:  # four equal gradients averaged: this rank's own, rounded
            assert torch.allclose(got.double(), own.double(), rtol=1e-2 if dtype ==
                                  torch.bfloat16 else 1e-6)
    with monkeypatch.context() as m:
        gathered, _, gather_stats = _run(_EchoWorld(wire=dtype), m, regions=False,
                                         dense_warmup_steps=10, dtype=dtype)
    for a, b in zip(params, gathered):
        assert torch.equal(a, b)
    # (P - 1) / P of the vector, then of the sums (float32 for bfloat16), against P - 1
    # vectors
    acc = 4 if dtype == torch.bfloat16 else dtype.itemsize
    item = dtype.itemsize
    assert gather_stats["bytes_received"] == 3 * sum(3 * p.numel() * item for p in params)
    assert stats["bytes_received"] == 3 * sum(
        3 * (p.numel() // 4) * item + (p.numel() - p.numel() // 4) * acc for p in params)


def test_small_buckets_float16_at_3_ranks_and_transports_without_alltoall_gather():
    big = 1 << 20
    assert dense_regions.applies(_EchoWorld(3), 3, big, 4, 4)
    assert not dense_regions.applies(_EchoWorld(2), 2, big, 4, 4)  # 2 ranks: the allreduce
    assert not dense_regions.applies(_EchoWorld(3), 3, 1000, 4, 4)  # one latency, not two
    # float16 on the wire, sums in float32: as many bytes as the gather at 3 ranks, fewer at 4
    assert not dense_regions.applies(_EchoWorld(3), 3, big, 2, 4)
    assert dense_regions.applies(_EchoWorld(4), 4, big, 2, 4)
    assert not dense_regions.applies(_NoAlltoall(4), 4, big, 4, 4)


def test_a_transport_without_alltoall_still_gathers(monkeypatch):
    world = _NoAlltoall()
    params, grads, stats = _run(world, monkeypatch, dense_warmup_steps=10)
    for step in grads:
        for got, own in step:
            assert torch.equal(got, own)
    assert world.alltoalls == 0


def test_the_bytes_rule_prices_dense_by_regions(monkeypatch):
    """At 4 ranks and density 0.3 the sparse allgather receives more than regions would, less
    than a gather: the bytes rule sends the bucket dense only when it knows regions."""
    n, k = 200_000, 60_000
    assert not costmodel.prefer_dense(n, k, 4, 4, 4, 4, dense_by="gather")
    assert costmodel.prefer_dense(n, k, 4, 4, 4, 4, dense_by="regions", sum_value_bytes=4)
    _, _, stats = _run(_EchoWorld(), monkeypatch, density=0.3, cost_model="bytes")
    assert stats["selected"] == stats["numel"]  # dense every step
    with monkeypatch.context() as m:
        _, _, gathered = _run(_EchoWorld(), m, regions=False, density=0.3, cost_model="bytes")
    assert gathered["selected"] < gathered["numel"]  # the gather's price kept it sparse
