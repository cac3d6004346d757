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
* **A rank that leaves is noticed.** Under Horovod a rank that finished (or called
  ``shutdown``) while others still run makes their next collective fail with
  ``HorovodInternalError``; under MPI they wait for it for ever. :class:`PeerExitWatch` has
  each leaving rank tell the others how many collectives it had started, so a rank waiting
  for a collective the leaver never started raises instead (:func:`watch`).
"""
from __future__ import annotations

import atexit
import hashlib
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


def pickled(obj) -> bytes:
    """``obj`` pickled (cloudpickle where installed, as Horovod's) behind a b"o", or behind a
    b"e" the reason it cannot be: sent in its place, so that every rank can say so."""
    try:
        return b"o" + _pickle().dumps(obj)
    except Exception as e:  # noqa: BLE001 - raised on every rank by unpickled()
        return b"e" + f"{type(e).__name__}: {e}".encode()


def unpickled(blobs, what: str, first: int = 0) -> list:
    """The objects :func:`pickled` made; where one could not be pickled, a ``TypeError`` on
    every rank alike naming its rank (counted from ``first``), where the rank that failed
    raised alone and the others failed or waited in their next collective."""
    for r, b in enumerate(blobs):
        if b[:1] == b"e":
            raise TypeError(f"{what}: rank {first + r} could not pickle its object "
                            f"({b[1:].decode(errors='replace')})")
    return [_pickle().loads(b[1:]) for b in blobs]


def _pickle():
    try:
        import cloudpickle
        return cloudpickle
    except ImportError:  # pragma: no cover - depends on the installation
        import pickle
        return pickle


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


def named(name) -> dict:
    """The ``name=`` a user gave a collective, as a field every rank must agree on: MPI
    matches collectives by call order, so ranks that started differently named ones in a
    different order would silently swap their results (Horovod matches them by name)."""
    return {} if name is None else {"name": str(name)}


def agree(comm, what: str, **fields) -> None:
    """Raise :class:`HorovodInternalError` on every rank unless every rank of ``comm`` is
    starting the collective ``what`` with the same ``fields``: 16-byte digests go first, in one
    non-blocking allgather (a wait that notices a rank that left, :class:`PeerExitWatch`),
    and only where they differ the descriptions themselves. Every rank sees the same lists,
    so all raise alike, or none does."""
    if comm.Get_size() == 1:
        return
    import numpy as np

    mine = (what, tuple(sorted(fields.items())))
    digest = np.frombuffer(hashlib.blake2b(repr(mine).encode(), digest_size=16).digest(),
                           dtype=np.uint8)
    everyone = np.empty((comm.Get_size(), digest.size), dtype=np.uint8)
    w = watch(comm)
    seq = w.post() if w is not None else None
    req = comm.Iallgather(digest, everyone)
    if w is not None:
        w.wait([req], seq)
    else:
        req.Wait()
    if (everyone == digest).all():
        return
    everyone = comm.allgather(mine)  # every rank is here: the digests came from all of them
    if all(x == mine for x in everyone):  # equal values written differently (1 and 1.0)
        return
    kinds = [x[0] for x in everyone]
    if len(set(kinds)) > 1:
        raise HorovodInternalError(
            "Mismatched collective operations: " + ", ".join(
                f"rank {r} started {k}" for r, k in enumerate(kinds))
            + " (MPI matches collectives by call order: every rank must start the same "
              "ones in the same order)")
    for key in sorted({k for x in everyone for k, _ in x[1]}):  # a field some ranks lack too
        values = [dict(x[1]).get(key) for x in everyone]
        if len(set(map(repr, values))) > 1:
            raise HorovodInternalError(
                f"Mismatched {key.replace('_', ' ')} in {what}: " + ", ".join(
                    f"rank {r}: {v}" for r, v in enumerate(values)))
    raise HorovodInternalError(f"Mismatched arguments in {what}")  # pragma: no cover


#: how long a leaving rank lets each collective it left in flight finish (seconds)
EXIT_GRACE_S = float(os.environ.get("HVD_SPARSE_EXIT_GRACE_S", "10"))
#: the tag of the notices a leaving rank sends, on the watch's own duplicate communicator
_NOTICE_TAG = 7077
_watches = []  # (communicator, its watch), at most a few


class PeerExitWatch:
    """Who left the job, and after how many collectives.

    MPI gives no error when a rank exits while others still call collectives: they wait for
    it for ever (Horovod instead shuts every rank down with ``HorovodInternalError``). Each
    rank counts the collectives it starts on ``comm`` (every rank starts the same ones in the
    same order, so the n-th is the same operation everywhere). A rank that leaves, at exit or
    in ``shutdown``, sends every other rank its count on a duplicate communicator, where each
    rank keeps one receive posted. A rank waiting for its n-th collective waits for that
    receive too: a leaver whose count is n or more started the collective (it completes); one
    whose count is lower never will, and the wait raises ``HorovodInternalError`` on the spot,
    as does every later collective. A rank killed outright sends nothing; mpirun ends that
    job itself. Costs one posted receive, and at exit one small message per rank.
    """

    def __init__(self, comm):
        import numpy as np
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm
        self.channel = comm.Dup()
        self.started = 0  # collectives this rank started on comm
        self.gone = {}  # rank -> how many it had started when it left
        self._buf = np.zeros(2, dtype=np.int64)
        self._recv = self._post_receive()
        self.closed = False
        self.in_flight = {}  # collective number -> (requests, the buffers they use)

    def _post_receive(self):
        return self.channel.Irecv([self._buf, self.MPI.INT64_T], source=self.MPI.ANY_SOURCE,
                                  tag=_NOTICE_TAG)

    def _note(self) -> None:
        """The notice just received: remember the rank, and listen again."""
        who, count = int(self._buf[0]), int(self._buf[1])
        self.gone[who] = count
        self._recv = self._post_receive()

    def _absent(self, seq):
        """Ranks that left before starting collective number ``seq``."""
        return sorted(r for r, count in self.gone.items() if count < seq)

    def _raise(self, seq, absent):
        raise HorovodInternalError(
            f"rank(s) {absent} of this job finished execution or shut down before the "
            f"collective this rank is starting (its collective number {seq}; rank(s) "
            f"{absent} started {min(self.gone[r] for r in absent)}): it can never complete. "
            "Horovod stops here too ('Horovod has been shut down'); every rank must run the "
            "same collectives, e.g. the same number of steps")

    def post(self) -> int:
        """Before this rank starts a collective: its number, or the error where a rank that
        left will never start it."""
        self.started += 1
        if not self.closed:
            while self._recv.Test():
                self._note()
        absent = self._absent(self.started)
        if absent:
            self._raise(self.started, absent)
        return self.started

    def track(self, seq, requests, buffers) -> None:
        """A collective left in flight (completed later by :meth:`wait`): if this rank leaves
        first, :meth:`close` still lets it finish, so MPI never writes into freed buffers."""
        self.in_flight[seq] = (requests, buffers)

    def wait(self, requests, seq) -> None:
        """Complete ``requests`` (collective number ``seq``), or raise as soon as a rank that
        left is known never to start it."""
        MPI = self.MPI
        pending = [r for r in requests if r != MPI.REQUEST_NULL]
        while pending:
            if self.closed:
                MPI.Request.Waitall(pending)
                return
            everyone = pending + [self._recv]
            index = MPI.Request.Waitany(everyone)
            if index == len(pending):
                self._note()
                absent = self._absent(seq)
                if absent:
                    self._raise(seq, absent)
            else:
                pending = [r for i, r in enumerate(everyone[:-1]) if i != index]
        self.in_flight.pop(seq, None)

    def _finish_in_flight(self) -> None:
        """Before leaving: the collectives this rank started and never waited for (it left in
        the middle of a step) are let finish where every rank may still start them, for at
        most EXIT_GRACE_S each; MPI would otherwise write into memory the interpreter is
        freeing. The others wait for them (they know this rank started them)."""
        import time

        for seq, (requests, _buffers) in sorted(self.in_flight.items()):
            deadline = time.monotonic() + EXIT_GRACE_S
            while not self._absent(seq) and time.monotonic() < deadline:
                if self.MPI.Request.Testall(requests):
                    break
                while self._recv.Test():
                    self._note()
                time.sleep(0.001)
        self.in_flight.clear()

    def close(self) -> None:
        """This rank leaves: every other rank learns how many collectives it started. Not
        after the script finalized MPI itself or freed the communicator (then nothing can
        be sent, and MPI would abort the job for the attempt)."""
        if self.closed:
            return
        import numpy as np

        MPI = self.MPI
        if MPI.Is_finalized() or self.comm == MPI.COMM_NULL or self.channel == MPI.COMM_NULL:
            self.closed = True
            return
        self._finish_in_flight()
        self.closed = True
        me = self.comm.Get_rank()
        note = np.array([me, self.started], dtype=np.int64)
        sends = [self.channel.Isend([note, MPI.INT64_T], dest=r, tag=_NOTICE_TAG)
                 for r in range(self.comm.Get_size()) if r != me]
        MPI.Request.Waitall(sends)  # a few bytes each: sent eagerly, nobody must receive them
        self._recv.Cancel()
        self._recv.Wait()


def watched(comm, start) -> None:
    """Run one non-blocking MPI collective, ``start()`` returning its request, to completion:
    counted and waited through ``comm``'s watch where there is one (so a rank that left
    before starting it is an error, not a wait), else plainly."""
    w = watch(comm)
    seq = w.post() if w is not None else None
    req = start()
    if w is None:
        req.Wait()
    else:
        w.wait([req], seq)


def watch(comm):
    """The :class:`PeerExitWatch` of ``comm`` (the one :func:`start_watch` made for it), or
    None: a communicator of the user's own, or one beside Horovod, is not watched."""
    for c, w in _watches:
        if c is comm:
            return w
    return None


def start_watch(comm):
    """Watch ``comm`` from now on (collective: every rank calls it), closing the watch at exit;
    not for one process, nor where ``HVD_SPARSE_WATCH_EXITS=0``."""
    if comm.Get_size() == 1 or os.environ.get("HVD_SPARSE_WATCH_EXITS") == "0" \
            or watch(comm) is not None:
        return watch(comm)
    w = PeerExitWatch(comm)
    _watches.append((comm, w))
    atexit.register(w.close)
    return w


def stop_watch(comm) -> None:
    """This rank leaves ``comm`` (``shutdown``): tell the others, stop watching."""
    for i, (c, w) in enumerate(_watches):
        if c is comm:
            w.close()
            del _watches[i]
            return


#: Horovod's names a script may reach for that the Horovod-free front ends do not offer
ELSEWHERE = {"elastic": "Horovod's elastic training needs Horovod's driver (horovodrun with "
                        "--host-discovery-script): use `import hvd_sparse as hvd` over Horovod, "
                        "whose hvd.elastic works with hvd_sparse's optimizer"}


def missing_name(module: str, name: str):
    """A front end's module ``__getattr__``: where a missing Horovod name is, if anywhere."""
    if name in ELSEWHERE:
        raise AttributeError(f"{module} has no {name!r}: {ELSEWHERE[name]}")
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
