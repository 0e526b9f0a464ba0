"""Keep the calling thread's signal stack across a call into a runtime that swaps it.

OpenVINO (2026.4, CPU plugin) gives the thread that compiles a model a signal stack of its own
(``sigaltstack``) and puts the previous one back when its ``Core`` goes, in the order the Cores
go rather than the reverse of the order they came: after two Cores ended first-made first, the
thread is left on a stack OpenVINO has unmapped. Python runs its signal handlers on the signal
stack (``SA_ONSTACK``), so the next signal with a Python handler -- Ctrl-C, the trainer's
SIGTERM handler, the SIGCHLD handler torch's DataLoader installs for its workers -- then kills
the process with SIGSEGV. :func:`kept_signal_stack` reads the thread's signal stack before the
call and puts it back after, so every stack OpenVINO remembers as "the previous one" is the
caller's, which stays valid.
"""
import contextlib
import ctypes
import ctypes.util
import logging
import sys
from typing import Iterator, Optional

logger = logging.getLogger(__name__)


class _StackT(ctypes.Structure):
    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


_libc: Optional[ctypes.CDLL] = None


def _sigaltstack() -> Optional[ctypes.CDLL]:
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            _libc.sigaltstack.argtypes = [ctypes.POINTER(_StackT), ctypes.POINTER(_StackT)]
        except (OSError, AttributeError):   # no libc to call: nothing to keep
            _libc = None
    return _libc


@contextlib.contextmanager
def kept_signal_stack() -> Iterator[None]:
    """Run the block, then give this thread back the signal stack it had before it."""
    libc = _sigaltstack()
    before = _StackT()
    if libc is None or libc.sigaltstack(None, ctypes.byref(before)) != 0:
        yield
        return
    try:
        yield
    finally:
        now = _StackT()
        libc.sigaltstack(None, ctypes.byref(now))
        if (now.ss_sp, now.ss_size, now.ss_flags) != (before.ss_sp, before.ss_size, before.ss_flags):
            restore = _StackT(before.ss_sp, before.ss_flags & 2, before.ss_size)   # SS_DISABLE or 0
            if libc.sigaltstack(ctypes.byref(restore), None) != 0:
                logger.warning("could not put this thread's signal stack back after OpenVINO (errno %d); "
                               "a signal handled in Python may crash this process", ctypes.get_errno())
