"""Reading a rank's stack: which frames are the user's code, basetrainer's, a collective's, the
DataLoader's or the backward pass's (:func:`frames`), from a live thread or an exception's
traceback; and the stacks faulthandler writes into ``crash-rank<k>.txt`` at a fatal signal
(:func:`read_crash`, :func:`alive`). Used by :mod:`basetrainer.runtime.stall_report` and
:mod:`basetrainer.runtime.crash_report`.
"""
import os
import re
import socket
import sysconfig
from typing import Any, Dict, List, Optional, Tuple

from basetrainer.runtime import processes

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SYSTEM = tuple(sorted({os.path.abspath(p) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")
                        if (p := sysconfig.get_paths().get(key))}))
_C10D = os.sep + os.path.join("torch", "distributed", "distributed_c10d.py")
_DATA = os.sep + os.path.join("torch", "utils", "data") + os.sep
_AUTOGRAD = os.sep + os.path.join("torch", "autograd") + os.sep
_DDP = os.sep + os.path.join("torch", "nn", "parallel", "distributed.py")


def _frame(entry: Optional[Tuple[str, int, str]]) -> Optional[Dict[str, Any]]:
    return None if entry is None else {"file": entry[0], "line": entry[1], "function": entry[2]}


def _last(entries: List[Tuple[str, int, str]], keep: Any) -> Optional[Tuple[str, int, str]]:
    return next((e for e in reversed(entries) if keep(e[0])), None)


def _is_user(path: str) -> bool:
    path = os.path.abspath(path)
    return not path.startswith(_PACKAGE) and not path.startswith(_SYSTEM) and not path.startswith("<")


# basetrainer's frames that a summary names otherwise (the collective, the callback, the watchdog)
_PLUMBING = tuple(os.path.join(_PACKAGE, *p.split("/")) for p in
                  ("runtime/comm.py", "callbacks/callbacks.py", "runtime/watchdog.py"))


def _is_library(path: str) -> bool:
    path = os.path.abspath(path)
    return path.startswith(_PACKAGE) and path not in _PLUMBING


def frames(entries: List[Tuple[str, int, str]]) -> Dict[str, Any]:
    """What a stack (``(file, line, function)``, outermost first) says of a rank's place: a torch
    collective called directly, the DataLoader or the backward pass waited in, and the innermost
    frame in the user's code, in basetrainer and overall."""
    c10d = [e for e in entries if e[0].endswith(_C10D) and e[2] not in ("wrapper", "_fn")]
    return {
        "torch_collective": c10d[0][2] if c10d else "",
        "waiting_for_data": any(_DATA in e[0] for e in entries),
        "in_backward": any(_AUTOGRAD in e[0] for e in entries),   # DDP's gradient all-reduce waits there
        # DDP's forward broadcasts the buffers (BatchNorm's statistics) from rank 0 first
        "ddp_broadcast": any(e[0].endswith(_DDP) and "broadcast" in e[2] for e in entries),
        "user": _frame(_last(entries, _is_user)),
        "library": _frame(_last(entries, _is_library)),
        "innermost": _frame(entries[-1] if entries else None),
    }


#: the first line of ``crash-rank<k>.txt``; faulthandler appends the stacks at a fatal signal
CRASH_HEADER = "basetrainer crash-rank{rank}: pid {pid} on {host}, main thread 0x{thread:016x}{elsewhere}\n"
#: the header's end when faulthandler was on before (its output goes where the user sent it)
ELSEWHERE = "; stacks at a fatal signal: where faulthandler was sent before the run"
_HEADER = re.compile(r"basetrainer crash-rank(\d+): pid (\d+) on (\S+), main thread 0x([0-9a-f]+)")
_THREAD = re.compile(r"(?:Current thread|Thread) 0x([0-9a-f]+)")
_FILE = re.compile(r'\s+File "(.*)", line (\d+) in (.*)')
_COMM = os.path.join(_PACKAGE, "runtime", "comm.py")


def comm_collective(entries: List[Tuple[str, int, str]]) -> str:
    """The comm collective a stack is in ("" when none)."""
    return next((e[2] for e in reversed(entries) if os.path.abspath(e[0]) == _COMM), "")


def _crash_file(folder: str, rank: int, since: float) -> Optional[Tuple[str, float, List[str], Any]]:
    """``crash-rank<k>.txt`` of rank ``rank`` written after ``since``: (path, mtime, lines, header
    match), or None (no such file, an earlier run's, or not one of ours)."""
    path = os.path.join(folder, f"crash-rank{rank}.txt")
    try:
        mtime = os.stat(path).st_mtime
        if mtime < since - 1:
            return None
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    header = _HEADER.match(lines[0]) if lines else None
    return (path, mtime, lines, header) if header is not None else None


def _runs(header: Any) -> bool:
    """Whether the process a header names runs (one on another machine is taken to)."""
    return header.group(3) != socket.gethostname() or processes.running(int(header.group(2)))


def read_crash(folder: str, rank: int, since: float) -> Optional[Dict[str, Any]]:
    """Rank ``rank``'s summary from the stacks faulthandler wrote into ``crash-rank<k>.txt`` when
    the process ended on a fatal signal (``crashed``: faulthandler's words, e.g. "Aborted"), or
    ``killed`` when the file holds only its header but the process is gone (SIGKILL). None: no
    such file (the rank never had one, or ended through Python), or the rank still runs."""
    found = _crash_file(folder, rank, since)
    if found is None:
        return None
    path, mtime, lines, header = found
    if len(lines) < 2:   # only the header: the rank runs, or was killed without a trace
        if _runs(header):
            return None
        return {"rank": rank, "host": header.group(3), "pid": int(header.group(2)), "time": mtime,
                "killed": ("ended on a signal, its stacks where faulthandler was sent before the run" if ELSEWHERE
                           in lines[0] else "ended without a Python trace (SIGKILL: e.g. the out-of-memory killer, "
                                            "or a job scheduler)"),
                "stall_timeout": 0, "steps": None, "seq": None, "stacks": path}
    fatal = next((t.split(":", 1)[1].strip() for t in lines if t.startswith("Fatal Python error:")), "a fatal signal")
    stacks: Dict[int, List[Tuple[str, int, str]]] = {}
    current: List[Tuple[str, int, str]] = []
    for line in lines[1:]:
        if thread := _THREAD.match(line):
            current = stacks.setdefault(int(thread.group(1), 16), [])
        elif entry := _FILE.match(line):
            current.append((entry.group(1), int(entry.group(2)), entry.group(3).strip()))
    entries = list(reversed(stacks.get(int(header.group(4), 16), [])))   # faulthandler: innermost first
    return {"rank": rank, "host": header.group(3), "pid": int(header.group(2)), "time": mtime,
            "crashed": fatal, "stall_timeout": 0, "progress": None, "steps": None, "callback": "",
            "collective": comm_collective(entries), "seq": None, "dataloader_workers": [], "stacks": path,
            **frames(entries)}


def alive(folder: str, rank: int, since: float) -> bool:
    """Whether rank ``rank`` of this machine still runs: its crash file holds only the header
    (removed when the rank ends through Python, filled at a fatal signal) and its pid lives."""
    found = _crash_file(folder, rank, since)
    return found is not None and len(found[2]) == 1 and _runs(found[3])
