"""What a stalled rank says about itself (:func:`summarize`), and the one report that puts the
ranks side by side and names the rank(s) that differ (:func:`gather`); written by
:mod:`basetrainer.runtime.watchdog`.

A summary reads the blocked thread's frames (``sys._current_frames()``) and names its innermost
frame in the user's code (neither basetrainer, the standard library nor an installed package),
in basetrainer, and overall; the comm collective it waits in and that collective's sequence
number in this process; a torch collective called directly (e.g. by a callback); the callback
that runs; and the DataLoader worker processes when it waits for a batch.
"""
import json
import multiprocessing
import os
import re
import socket
import sys
import sysconfig
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

#: the report's file name, beside the ranks' ``stall-rank<k>.txt``
REPORT = "stall-report.txt"

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SYSTEM = tuple(sorted({os.path.abspath(p) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")
                        if (p := sysconfig.get_paths().get(key))}))
_C10D = os.sep + os.path.join("torch", "distributed", "distributed_c10d.py")
_DATA = os.sep + os.path.join("torch", "utils", "data") + os.sep
_AUTOGRAD = os.sep + os.path.join("torch", "autograd") + os.sep


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


def summarize(thread: Optional[int], rank: int, progress: Any, idle: float, timeout: float,
              announced_by: Optional[int]) -> Dict[str, Any]:
    """Where thread ``thread`` of this process is, as a JSON-ready dict."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    entries = [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_stack(frame)] if frame else []
    place = frames(entries)
    workers = sorted(p.pid for p in multiprocessing.active_children() if p.pid) if place["waiting_for_data"] else []
    return {
        "rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
        "idle_s": round(idle, 1), "stall_timeout": timeout, "announced_by": announced_by,
        "progress": progress.count, "callback": progress.where,
        "collective": progress.collective, "seq": progress.seq,
        "dataloader_workers": workers, **place,
    }


def frames(entries: List[Tuple[str, int, str]]) -> Dict[str, Any]:
    """What a stack (``(file, line, function)``, outermost first) says of a rank's place: a torch
    collective called directly, the DataLoader or the backward pass waited in, and the innermost
    frame in the user's code, in basetrainer and overall."""
    c10d = [e for e in entries if e[0].endswith(_C10D) and e[2] not in ("wrapper", "_fn")]
    return {
        "torch_collective": c10d[0][2] if c10d else "",
        "waiting_for_data": any(_DATA in e[0] for e in entries),
        "in_backward": any(_AUTOGRAD in e[0] for e in entries),   # DDP's gradient all-reduce waits there
        "user": _frame(_last(entries, _is_user)),
        "library": _frame(_last(entries, _is_library)),
        "innermost": _frame(entries[-1] if entries else None),
    }


def workers(folder: str, rank: int, pids: List[int], since: float, wait: float) -> List[Dict[str, Any]]:
    """The summaries rank ``rank``'s DataLoader workers wrote (``stall-rank<k>-worker<w>.json``),
    waiting up to ``wait`` seconds for one per worker process in ``pids``."""
    deadline = time.monotonic() + wait
    found: Dict[str, Dict[str, Any]] = {}
    prefix = f"stall-rank{rank}-worker"
    while True:
        try:
            names = [n for n in os.listdir(folder) if n.startswith(prefix) and n.endswith(".json")]
        except OSError:
            names = []
        for name in names:
            if name not in found:
                path = os.path.join(folder, name)
                try:
                    if os.stat(path).st_mtime >= since - 1:
                        with open(path, encoding="utf-8") as f:
                            found[name] = json.load(f)
                except (OSError, ValueError):
                    pass
        if len(found) >= len(pids) or time.monotonic() >= deadline:
            return sorted(found.values(), key=lambda s: s.get("worker", 0))
        time.sleep(0.1)


def describe_worker(s: Dict[str, Any]) -> str:
    """One DataLoader worker's place, in one line."""
    if s.get("loading") is None:
        return f"worker {s['worker']} (pid {s['pid']}) of rank {s['rank']}: not loading a batch"
    return (f"worker {s['worker']} (pid {s['pid']}) of rank {s['rank']}: loading sample index(es) {s['loading']} "
            f"for {s['loading_s']:g} s, user code at {_at(s.get('user'))}, innermost {_at(s.get('innermost'))}")


def _at(frame: Optional[Dict[str, Any]]) -> str:
    return f"{frame['function']} ({frame['file']}:{frame['line']})" if frame else "-"


def describe(s: Dict[str, Any]) -> str:
    """One rank's place, in one line."""
    parts = [f"rank {s['rank']} (pid {s['pid']} on {s['host']}):"]
    if s.get("crashed"):
        parts.append(f"ended on a fatal signal ({s['crashed']}; gloo aborts a process whose collective receives a "
                     f"message of another size: a collective mismatch),")
    elif s.get("failed"):
        parts.append(f"its collective failed ({s['failed']}),")
    if s.get("callback"):
        parts.append(f"in {s['callback']},")
    if s.get("collective"):
        number = f"#{s['seq']} " if s.get("seq") is not None else ""
        verb = "in" if s.get("crashed") or s.get("failed") else "waiting in"
        parts.append(f"{verb} collective {number}{s['collective']} (basetrainer.runtime.comm),")
    elif s.get("torch_collective"):
        parts.append(f"waiting in torch.distributed.{s['torch_collective']} called outside basetrainer's "
                     f"collectives{_done(s)},")
    elif s.get("in_backward"):
        parts.append(f"in the backward pass (with DDP: its gradient all-reduce, which waits for every rank"
                     f"{_done(s, ';')}),")
    else:
        parts.append(f"in no collective{_done(s)},")
    if s.get("waiting_for_data"):
        workers = s.get("dataloader_workers") or []
        parts.append(f"waiting for a batch from the DataLoader (worker pids {workers}),")
        loading = [w for w in s.get("workers") or [] if w.get("loading") is not None]
        if loading:
            parts.append("; ".join(describe_worker(w) for w in loading) + ";")
    parts.append(f"user code at {_at(s.get('user'))}, basetrainer at {_at(s.get('library'))}, "
                 f"innermost {_at(s.get('innermost'))}")
    return " ".join(parts)


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole (a temp file, then a rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _done(s: Dict[str, Any], sep: str = "") -> str:
    if s.get("seq") is None:   # a crashed rank's stacks do not say
        return ""
    return f"{sep} {s['seq']} of basetrainer's collectives done" if sep else f" ({s['seq']} done)"


def _load(folder: str, rank: int, since: float) -> Optional[Dict[str, Any]]:
    path = os.path.join(folder, f"stall-rank{rank}.json")
    try:
        if os.stat(path).st_mtime < since - 1:
            return None   # an earlier run's
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return read_crash(folder, rank, since)


#: the first line of ``crash-rank<k>.txt``; faulthandler appends the stacks at a fatal signal
CRASH_HEADER = "basetrainer crash-rank{rank}: pid {pid} on {host}, main thread 0x{thread:016x}\n"
_HEADER = re.compile(r"basetrainer crash-rank(\d+): pid (\d+) on (\S+), main thread 0x([0-9a-f]+)")
_THREAD = re.compile(r"(?:Current thread|Thread) 0x([0-9a-f]+)")
_FILE = re.compile(r'\s+File "(.*)", line (\d+) in (.*)')
_COMM = os.path.join(_PACKAGE, "runtime", "comm.py")


def comm_collective(entries: List[Tuple[str, int, str]]) -> str:
    """The comm collective a stack is in ("" when none)."""
    return next((e[2] for e in reversed(entries) if os.path.abspath(e[0]) == _COMM), "")


def read_crash(folder: str, rank: int, since: float) -> Optional[Dict[str, Any]]:
    """Rank ``rank``'s summary from the stacks faulthandler wrote into ``crash-rank<k>.txt`` when
    the process ended on a fatal signal (None: no such file, or only its header)."""
    path = os.path.join(folder, f"crash-rank{rank}.txt")
    try:
        stat = os.stat(path)
        if stat.st_mtime < since - 1:
            return None
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    header = _HEADER.match(lines[0]) if lines else None
    if header is None or len(lines) < 2:
        return None
    fatal = next((t.split(":", 1)[1].strip() for t in lines if t.startswith("Fatal Python error:")), "a fatal signal")
    stacks: Dict[int, List[Tuple[str, int, str]]] = {}
    current: List[Tuple[str, int, str]] = []
    for line in lines[1:]:
        if thread := _THREAD.match(line):
            current = stacks.setdefault(int(thread.group(1), 16), [])
        elif entry := _FILE.match(line):
            current.append((entry.group(1), int(entry.group(2)), entry.group(3).strip()))
    entries = list(reversed(stacks.get(int(header.group(4), 16), [])))   # faulthandler: innermost first
    return {"rank": rank, "host": header.group(3), "pid": int(header.group(2)), "time": stat.st_mtime,
            "crashed": fatal, "stall_timeout": 0, "progress": None, "callback": "",
            "collective": comm_collective(entries), "seq": None, "dataloader_workers": [], "stacks": path,
            **frames(entries)}


def gather(folder: str, world_size: int, since: float, seconds: float, title: Optional[str] = None) -> str:
    """The report: the summaries the ranks wrote in ``folder`` (waiting up to ``seconds`` for
    them all), one line each, and the rank(s) that differ. ``title``: its first line (default:
    a stall's)."""
    deadline = time.monotonic() + seconds
    summaries: Dict[int, Dict[str, Any]] = {}
    while True:
        for rank in range(world_size):
            if rank not in summaries and (s := _load(folder, rank, since)) is not None:
                summaries[rank] = s
        if len(summaries) == world_size or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    timeout = max((s["stall_timeout"] for s in summaries.values()), default=0)
    first = min(summaries.values(), key=lambda s: s["time"]) if summaries else None
    lines = [title or f"basetrainer stall report: no progress for stall_timeout = {timeout:g} s "
             f"({world_size} rank{'s' if world_size > 1 else ''}"
             + (f"; rank {first['rank']} stalled first" if first and world_size > 1 else "") + ")"]
    for rank in range(world_size):
        lines.append(describe(summaries[rank]) if rank in summaries
                     else f"rank {rank}: no summary within {seconds:g} s (its watchdog did not run: on another "
                          f"machine without this folder, or a thread holding the interpreter lock)")
    lines.append(differs(summaries, world_size))
    crashed = [r for r, s in summaries.items() if s.get("crashed")]
    lines.append(f"Python stacks of every thread: {os.path.join(folder, 'stall-rank<k>.txt')}"
                 + (f" ({os.path.join(folder, 'crash-rank<k>.txt')} for rank(s) {crashed})" if crashed else ""))
    return "\n".join(lines)


def _place(s: Dict[str, Any]) -> Tuple[Any, ...]:
    user, library = s.get("user") or {}, s.get("library") or {}
    return (_waiting(s), s.get("seq"), s.get("callback"),
            user.get("file"), user.get("function"), library.get("file"), library.get("function"))


def _waiting(s: Dict[str, Any]) -> str:
    """The collective a rank waits in ("" when it waits for none)."""
    return s.get("collective") or s.get("torch_collective") or ("backward" if s.get("in_backward") else "")


def _position(s: Dict[str, Any]) -> float:
    """How far a rank got: comm collectives done (half of one more while waiting in one)."""
    return s["seq"] - 0.5 if s.get("collective") else float(s["seq"])


def differs(summaries: Dict[int, Dict[str, Any]], world_size: int) -> str:
    """The line that names the rank(s) whose place differs from the others'."""
    missing = [r for r in range(world_size) if r not in summaries]
    if world_size == 1:
        return "one process: it is stalled at the place above"
    crashed = sorted(r for r, s in summaries.items() if s.get("crashed"))
    if crashed:   # its collective met another kind or size of message: the ranks' collectives differ
        return (f"differs: rank(s) {crashed}: ended on a fatal signal in the place above, and the others' collectives "
                f"failed with it. A collective mismatch: one rank skipped or repeated a step (an exception "
                f"swallowed in train_step?), or ran a collective that the others did not")
    groups: Dict[Tuple[Any, ...], List[int]] = {}
    for rank, s in sorted(summaries.items()):
        groups.setdefault(_place(s), []).append(rank)
    if len(groups) <= 1:
        if missing:
            return f"differs: rank(s) {missing} (no summary); the others wait at the same place"
        return "no rank differs: every rank waits at the same place (a stall every rank shares, e.g. a data " \
               "worker or a server they all wait for)"
    sizes = sorted((len(g) for g in groups.values()), reverse=True)
    if sizes[0] > sizes[1]:
        majority = max(groups.values(), key=len)
        odd = sorted(r for g in groups.values() if g is not majority for r in g) + missing
        return f"differs: rank(s) {odd}; rank(s) {majority} are at the same place"
    behind = min(_position(s) for s in summaries.values())
    odd = sorted(r for r, s in summaries.items() if _position(s) == behind)
    if len(odd) == len(summaries):   # as far: the ones not waiting for the others differ
        odd = sorted(r for r, s in summaries.items() if not _waiting(s))
    if not odd or len(odd) == len(summaries):
        return f"differs: the ranks are at {len(groups)} different places (above)" + \
            (f"; no summary from rank(s) {missing}" if missing else "")
    return (f"differs: rank(s) {odd + missing}: behind the others (fewer of basetrainer's collectives done, "
            f"or not waiting in one), while the other rank(s) wait for them")
