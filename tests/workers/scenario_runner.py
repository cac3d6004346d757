"""The entry point every scenario worker shares: ``python WORKER OUTDIR [NAME ...]`` runs the
worker's scenarios (or only the named ones) on this rank, records each one's exception instead
of stopping, and writes OUTDIR/rank<r>.json for the pytest side to assert on."""
import json
import os
import sys
import traceback

from hvd_sparse.engine.agreement import state_digest


def same_everywhere(hvd, obj) -> bool:
    """True when every rank holds bitwise the same tensors and plain values (nested)."""
    digests = hvd.allgather_object(state_digest(obj).hex())
    return all(d == digests[0] for d in digests)


def run_scenarios(hvd, scenarios):
    outdir = sys.argv[1]
    only = set(sys.argv[2:])
    hvd.init()
    res = {"rank": hvd.rank(), "size": hvd.size()}
    for fn in scenarios:
        if only and fn.__name__ not in only:
            continue
        try:
            fn(res)
        except Exception:
            res.setdefault("errors", {})[fn.__name__] = traceback.format_exc()
    with open(os.path.join(outdir, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    hvd.shutdown()
