"""What Horovod's coordinator gives a job that plain MPI does not, for :mod:`hvd_sparse.mpi`.

* **A failing rank stops the job.** Under Horovod an exception on one rank shuts Horovod down
  and every other rank gets ``HorovodInternalError``; under MPI the failing rank waits in
  ``MPI_Finalize`` at exit and the others wait in their next collective, for ever.
  :func:`abort_on_uncaught` makes an uncaught exception print its traceback and then abort the
  whole job (``MPI_Abort``), as ``python -m mpi4py`` does.
* **Ranks that disagree get an error, not garbage.** Horovod checks that every rank submitted
  the same operation, dtype, shape, reduction op, root and scale factors, and raises
  ``HorovodInternalError`` on every rank where they differ. MPI moves bytes: different shapes
  hang or abort, different dtypes are reinterpreted, different ops give each rank another
  answer. :func:`agree` compares every rank's description of the collective it is starting
  through one small allgather and raises the same error on every rank (the job can go on).
"""
from __future__ import annotations

import operator
import os
import sys

try:  # pragma: no branch
    from horovod.common.exceptions import HorovodInternalError  # noqa: F401
except ImportError:  # Horovod missing: the same name and base
    class HorovodInternalError(RuntimeError):
        """A collective could not complete as submitted (Horovod's exception, same base)."""

_installed = []


def abort_on_uncaught(comm) -> None:
    """Chain ``sys.excepthook`` so that an uncaught exception, after its traceback is printed,
    aborts every rank of ``comm`` (once per process; not for one process, nor where
    ``HVD_SPARSE_ABORT_ON_ERROR=0``)."""
    if _installed or comm.Get_size() == 1 or os.environ.get("HVD_SPARSE_ABORT_ON_ERROR") == "0":
        return
    previous = sys.excepthook

    def hook(kind, value, traceback):
        try:
            previous(kind, value, traceback)
            sys.stderr.write(f"hvd_sparse.mpi: uncaught {kind.__name__} on rank "
                             f"{comm.Get_rank()}: aborting the job (as Horovod shuts down; "
                             "HVD_SPARSE_ABORT_ON_ERROR=0 to wait instead)\n")
            sys.stderr.flush()
        finally:
            comm.Abort(1)

    sys.excepthook = hook
    _installed.append(hook)


def check_root(root_rank, size: int) -> int:
    """``root_rank`` as a Python int; a root outside the job is a ``ValueError``, on every
    rank alike (as under Horovod; MPI would fail with ``MPI_ERR_ROOT``, torch.distributed in
    its own way)."""
    try:  # any integer Horovod takes: numpy's (np.argmax), a 0-d integer tensor
        index = None if isinstance(root_rank, bool) else operator.index(root_rank)
    except TypeError:
        index = None
    if index is None or not 0 <= index < size:
        raise ValueError(f"root_rank {root_rank!r} is not a rank of this job (size {size})")
    return index


def describe(tensor, **more) -> dict:
    """The fields of a tensor collective that every rank must agree on."""
    return {"dtype": str(tensor.dtype), "shape": tuple(tensor.shape), **more}


def agree(comm, what: str, **fields) -> None:
    """Raise :class:`HorovodInternalError` on every rank unless every rank of ``comm`` is
    starting the collective ``what`` with the same ``fields`` (one allgather of a few bytes;
    every rank sees the same list, so all raise alike, or none does)."""
    if comm.Get_size() == 1:
        return
    mine = (what, tuple(sorted(fields.items())))
    everyone = comm.allgather(mine)
    if all(x == mine for x in everyone):
        return
    kinds = [x[0] for x in everyone]
    if len(set(kinds)) > 1:
        raise HorovodInternalError(
            "Mismatched collective operations: " + ", ".join(
                f"rank {r} started {k}" for r, k in enumerate(kinds))
            + " (MPI matches collectives by call order: every rank must start the same "
              "ones in the same order)")
    for key in sorted(fields):
        values = [dict(x[1]).get(key) for x in everyone]
        if len(set(map(repr, values))) > 1:
            raise HorovodInternalError(
                f"Mismatched {key.replace('_', ' ')} in {what}: " + ", ".join(
                    f"rank {r}: {v}" for r, v in enumerate(values)))
    raise HorovodInternalError(f"Mismatched arguments in {what}")  # pragma: no cover


#: Horovod's names a script may reach for that the Horovod-free front ends do not offer
ELSEWHERE = {"elastic": "Horovod's elastic training needs Horovod's driver (horovodrun with "
                        "--host-discovery-script): use `import hvd_sparse as hvd` over Horovod, "
                        "whose hvd.elastic works with hvd_sparse's optimizer"}


def missing_name(module: str, name: str):
    """A front end's module ``__getattr__``: where a missing Horovod name is, if anywhere."""
    if name in ELSEWHERE:
        raise AttributeError(f"{module} has no {name!r}: {ELSEWHERE[name]}")
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
