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
import socket
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

from basetrainer.runtime.stacks import frames, read_crash

#: the report's file name, beside the ranks' ``stall-rank<k>.txt``
REPORT = "stall-report.txt"


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
        "progress": progress.count, "callback": progress.where, "steps": progress.steps, "batches": progress.batches,
        "collective": progress.collective, "seq": progress.seq,
        "dataloader_workers": workers, **place,
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
    if s.get("killed"):
        return " ".join(parts + [s["killed"]])
    if s.get("crashed"):
        parts.append(f"ended on a fatal signal ({s['crashed']}; gloo aborts a process whose collective receives a "
                     f"message of another size: a collective mismatch),")
    elif s.get("failed"):
        parts.append(f"its collective failed ({s['failed']}),")
    if s.get("batches"):   # a train phase (evaluate and predict run none)
        parts.append(f"{s['batches']} train batches done, {s['steps']} of them through the engine's train_step,")
    if s.get("callback"):
        parts.append(f"in {s['callback']},")
    if s.get("collective"):
        number = f"#{s['seq']} " if s.get("seq") is not None else ""
        verb = "in" if s.get("crashed") or s.get("failed") else "waiting in"
        parts.append(f"{verb} collective {number}{s['collective']} (basetrainer.runtime.comm),")
    elif s.get("torch_collective"):
        parts.append(f"waiting in torch.distributed.{s['torch_collective']} called outside basetrainer's "
                     f"collectives{_done(s)},")
    elif s.get("ddp_broadcast"):
        parts.append(f"in DDP's forward (its broadcast of the buffers, e.g. BatchNorm's statistics, which waits "
                     f"for every rank{_done(s, ';')}),")
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
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:   # a full disk: no temp file left behind
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


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


_NO_SUMMARY = ("its watchdog did not run: on another machine without this folder, or a thread holding the "
               "interpreter lock")


def gather(folder: str, world_size: int, since: float, seconds: float, title: Optional[str] = None,
           no_summary: str = _NO_SUMMARY, known: Optional[Dict[int, Dict[str, Any]]] = None) -> str:
    """The report: the summaries the ranks wrote in ``folder`` (waiting up to ``seconds`` for
    them all), one line each, and the rank(s) that differ. ``title``: its first line (default:
    a stall's); ``no_summary``: why a rank may have written none; ``known``: summaries at hand."""
    deadline = time.monotonic() + seconds
    summaries: Dict[int, Dict[str, Any]] = dict(known or {})
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
                     else f"rank {rank}: no summary within {seconds:g} s ({no_summary})")
    lines.append(differs(summaries, world_size))
    crashed = sorted(r for r, s in summaries.items() if s.get("crashed"))
    failed = sorted(r for r, s in summaries.items() if s.get("failed"))
    stalled = sorted(r for r, s in summaries.items() if not s.get("crashed") and not s.get("failed")
                     and not s.get("killed"))
    where = [f"Python stacks of every thread: {os.path.join(folder, 'stall-rank<k>.txt')} for rank(s) {stalled}"
             if stalled else "",
             f"tracebacks: {os.path.join(folder, 'stall-rank<k>.txt')} for rank(s) {failed}" if failed else "",
             f"stacks at the fatal signal: {os.path.join(folder, 'crash-rank<k>.txt')} for rank(s) {crashed}"
             if crashed else ""]
    lines.append("; ".join(w for w in where if w))
    return "\n".join(lines)


def _place(s: Dict[str, Any]) -> Tuple[Any, ...]:
    user, library = s.get("user") or {}, s.get("library") or {}
    return (_waiting(s), s.get("seq"), s.get("callback"),
            user.get("file"), user.get("function"), library.get("file"), library.get("function"))


def _waiting(s: Dict[str, Any]) -> str:
    """The collective a rank waits in ("" when it waits for none)."""
    return (s.get("collective") or s.get("torch_collective") or ("ddp broadcast" if s.get("ddp_broadcast") else "")
            or ("backward" if s.get("in_backward") else ""))


def _position(s: Dict[str, Any]) -> float:
    """How far a rank got: comm collectives done (half of one more while waiting in one)."""
    return s["seq"] - 0.5 if s.get("collective") else float(s["seq"])


def differs(summaries: Dict[int, Dict[str, Any]], world_size: int) -> str:
    """The line that names the rank(s) whose place differs from the others'."""
    missing = [r for r in range(world_size) if r not in summaries]
    if world_size == 1:
        return "one process: it is stalled at the place above"
    crashed = sorted(r for r, s in summaries.items() if s.get("crashed"))
    dead = sorted(r for r, s in summaries.items() if s.get("crashed") or s.get("killed"))
    own = sorted(r for r, s in summaries.items() if s.get("torch_collective") and not s.get("collective")
                 and r not in dead)
    if dead and own:   # a collective of the user's own, run by some ranks only
        return (f"differs: rank(s) {own}: in a torch.distributed collective of their own (above) when rank(s) "
                f"{dead} ended (gloo aborts a process at a message of another size): likely a collective the other "
                f"ranks did not run")
    if crashed:   # its collective met another kind or size of message: the ranks' collectives differ
        return (f"differs: rank(s) {crashed}: aborted by gloo in the place above (its collective received a message "
                f"of another size), and the others' collectives failed with it. The ranks' collectives did not "
                f"match: one rank skipped or repeated a step (an exception swallowed in train_step?), or ran a "
                f"collective the others did not; the aborted rank is where it was detected")
    # a rank whose train batches outnumber its train steps while another's do not: its override of
    # train_step returned without the engine's step (an override that never calls it: all alike)
    deficit = {r: s["batches"] - s["steps"] for r, s in summaries.items() if s.get("batches") is not None}
    skipped = sorted(r for r, d in deficit.items() if d > 0 and min(deficit.values()) < d)
    # every rank runs every step's collectives (DDP's): one that skipped a step pairs them wrongly
    # (checked after a crash: a rank may then have swallowed its own failed collective)
    if skipped:
        return (f"differs: rank(s) {skipped}: finished train batches without the engine's train step (its forward, "
                f"backward and DDP's collectives; an exception swallowed in train_step?): its collectives no longer "
                f"pair with the other ranks'")
    ended = sorted(r for r, s in summaries.items() if s.get("killed"))
    if ended:
        return f"differs: rank(s) {ended}: ended on a signal (above); the others' collectives failed with it"
    if missing and any(s.get("failed") for s in summaries.values()):
        return (f"differs: rank(s) {missing}: ended first (no summary: an exception or exit, its traceback shown by "
                f"the launcher); the others' collectives failed with it")
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
