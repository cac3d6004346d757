"""Zero-fill of large CPU buffers with streaming (non-temporal) stores.

Why: the engine zeroes ``p.grad`` once per step before writing the k selected entries (the
write that replaces Horovod's dense result). A plain fill (torch's ``zero_``, ``memset``)
first reads every cache line it writes (read-for-ownership), so 4 bytes per entry cost 8 of
memory traffic; glibc switches ``memset`` to streaming stores only above about three
quarters of the last-level cache (48 MB on the 2-core development machine), which a
gradient rarely reaches. Streaming stores write the lines without reading them: 45.6 MB took
2.1-2.8 ms against 5.3-6.1 ms for ``zero_`` on one thread there. numba exposes no streaming
store, so the loop is a few lines of LLVM IR compiled with llvmlite (numba's own LLVM
binding, already installed); where that is not possible (another architecture, an llvmlite
without the API) :func:`zero_` is ``torch.Tensor.zero_``. Same bits either way.
"""
from __future__ import annotations

import ctypes
import os
import threading

import torch

#: below this many bytes the buffer is likely still in cache and a plain fill is as fast
MIN_BYTES = 1 << 20
_VECTOR_BYTES = 32  # one <8 x float> store; the body needs this alignment

_IR = r"""
define void @hvd_sparse_stream_zero(ptr %p, i64 %n) {
entry:
  %empty = icmp eq i64 %n, 0
  br i1 %empty, label %exit, label %loop
loop:
  %i = phi i64 [0, %entry], [%next, %loop]
  %q = getelementptr i8, ptr %p, i64 %i
  store <8 x float> zeroinitializer, ptr %q, align 32, !nontemporal !0
  %next = add i64 %i, 32
  %done = icmp uge i64 %next, %n
  br i1 %done, label %exit, label %loop
exit:
  fence seq_cst
  ret void
}
!0 = !{i32 1}
"""

_lock = threading.Lock()
_state = {"fn": None, "tried": False, "engine": None}


def _compile():
    """The streaming fill as a ctypes function ``f(address, bytes)`` (bytes a multiple of 32,
    address 32-byte aligned), or None where it cannot be built."""
    try:
        import llvmlite.binding as llvm

        try:
            llvm.initialize_native_target()
            llvm.initialize_native_asmprinter()
        except RuntimeError:  # newer llvmlite initialises itself
            pass
        mod = llvm.parse_assembly(_IR)
        mod.verify()
        target = llvm.Target.from_default_triple()
        machine = target.create_target_machine(
            cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(),
            opt=2)
        engine = llvm.create_mcjit_compiler(mod, machine)
        engine.finalize_object()
        addr = engine.get_function_address("hvd_sparse_stream_zero")
        if not addr:
            return None
        _state["engine"] = engine  # the code lives as long as its engine
        return ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)(addr)
    except Exception:  # noqa: BLE001 - any failure means: use torch's fill
        return None


def _function():
    """The compiled fill, built on first use; None where it cannot be, or with
    ``HVD_SPARSE_STREAM_ZERO=off`` (torch's fill, for comparisons)."""
    if not _state["tried"]:
        with _lock:
            if not _state["tried"]:
                _state["fn"] = None if os.environ.get("HVD_SPARSE_STREAM_ZERO") == "off" \
                    else _compile()
                _state["tried"] = True
    return _state["fn"]


def available() -> bool:
    """Whether the streaming fill could be built on this machine."""
    return _function() is not None


def zero_(t: torch.Tensor) -> torch.Tensor:
    """``t.zero_()``, with streaming stores for a large contiguous CPU buffer. In place; the
    tensor's version counter moves as with ``zero_`` (``t.zero_()`` does the unaligned ends,
    or everything when the buffer is small, on another device or not contiguous)."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < MIN_BYTES or not t.is_contiguous() \
            or t.requires_grad or t.is_sparse:
        return t.zero_()
    fn = _function()
    if fn is None:
        return t.zero_()
    start = t.data_ptr()
    flat = t.view(-1).view(torch.uint8)
    head = (-start) % _VECTOR_BYTES
    body = (nbytes - head) // _VECTOR_BYTES * _VECTOR_BYTES
    if head:
        flat[:head].zero_()
    fn(start + head, body)
    tail = nbytes - head - body
    if tail:
        flat[head + body:].zero_()
    if not head and not tail:  # an empty in-place op: moves the version counter as zero_ does
        flat[:0].zero_()
    return t
