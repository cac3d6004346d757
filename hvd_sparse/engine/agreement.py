"""Bringing every rank to the same replicated state before an exchange.

Replicas stay bitwise identical only if every rank starts a step from the same replicated state
(downlink residuals, step counters, sparsifier state, the cost model's choices, anchors). Three
events can break that without any rank noticing:

* a resume where only rank 0 loads the checkpoint (Horovod's ``broadcast_optimizer_state`` then
  copies the base optimizer's state, never hvd_sparse's);
* an elastic reset, where a joining worker starts fresh next to survivors;
* ``load_state_dict`` of a state saved by another rank or job.

So before the first exchange, after ``load_state_dict`` and after the world size changes, every
rank takes part in one small allgather: a digest of its configuration (a mismatch raises
:class:`hvd_sparse.safety.ConfigMismatchError`) and a digest of its replicated state. Only when
the state digests differ does the root (rank 0, the rank that holds the checkpoint in the usual
pattern) send its replicated state, which the other ranks adopt. Per-rank state (uplink
residuals, momentum-correction velocity, statistics) never travels.
"""
from __future__ import annotations

import hashlib
import io
import json
from typing import Optional

import torch

from .. import checkpoint, safety

DIGEST_BYTES = 32


def state_digest(obj) -> bytes:
    """A digest of nested dicts/lists of tensors and plain values: equal exactly when every
    tensor's dtype, shape and bits and every plain value are equal (dict order ignored)."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.digest()


def _feed(h, obj):
    if isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous().cpu()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    elif isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=repr):
            h.update(repr(k).encode())
            _feed(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _feed(h, v)
        h.update(b"]")
    else:
        h.update(repr(obj).encode())


def agree(transport, description: Optional[dict], replicated: dict,
          root: int = 0, fingerprint: bytes = b"", flag: bool = False):
    """Run the agreement on every rank (a collective). Returns (the root's replicated state
    when this rank's differs from it, else ``None``; whether any rank raised ``flag``); raises
    on a configuration mismatch.

    ``description``: what must be equal on every rank (``None``: not compared).
    ``fingerprint``: the optimizer's (:func:`hvd_sparse.safety.exchange_fingerprint`).
    ``flag``: a rank's own news that every rank must learn (one byte of the same gather)."""
    text = b"" if description is None else \
        json.dumps(description, sort_keys=True, default=str).encode()
    n = len(fingerprint)
    mine = fingerprint + hashlib.sha256(text).digest() + state_digest(replicated) + \
        bytes([bool(flag)])
    digests = safety._gather_bytes(transport, mine, "hvd_sparse.agree")
    anyone = any(d[-1] for d in digests)
    other_optimizer = any(d[:n] != digests[0][:n] for d in digests)
    digests = [d[n:-1] for d in digests]
    if other_optimizer or any(d[:DIGEST_BYTES] != digests[0][:DIGEST_BYTES] for d in digests):
        # (a model that differs and another optimizer's exchange look alike here: the first
        # difference is named, with the other possible cause)
        safety.raise_config_mismatch(transport, text, other_optimizer=other_optimizer)
    states = [d[DIGEST_BYTES:] for d in digests]
    if all(s == states[root] for s in states):
        return None, anyone
    blob = b""
    if transport.rank() == root:
        buf = io.BytesIO()
        torch.save(checkpoint.loadable(_to_cpu(replicated)), buf)
        blob = buf.getvalue()
    data = safety._gather_bytes(transport, blob, "hvd_sparse.agree.state")[root]
    if states[transport.rank()] == states[root]:
        return None, anyone
    return torch.load(io.BytesIO(data), weights_only=True), anyone


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
