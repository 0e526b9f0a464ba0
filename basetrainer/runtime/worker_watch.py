"""The stall watch of a DataLoader worker process: when its rank announces a stall (the
watchdog's trigger file, :mod:`basetrainer.runtime.watchdog`), the worker says which samples it
is loading and for how long, so a worker that hangs (alive, no batch) is named with its indices.

Nothing is added per item or per batch: the indices are read from the frame of torch's fetcher
in the worker's main thread (``possibly_batched_index``), by a daemon thread that wakes once a
second. Started by the loader's ``worker_init_fn`` (:mod:`basetrainer.dataloader.loader`).
"""
import faulthandler
import json
import os
import sys
import threading
import time
from typing import Any, Optional, Tuple

from basetrainer.runtime import stall_report, watchdog

_FETCH = os.sep + os.path.join("torch", "utils", "data", "_utils", "fetch.py")


class WorkerWatch:
    """In a DataLoader worker process: a daemon thread that, when its rank announces a stall,
    writes ``stall-rank<k>-worker<w>.json`` and ``.txt``: the sample indices the worker is loading
    (read from the fetch frame of its main thread: nothing is added per item), for how long, the
    innermost frame of the user's code, and every thread's stack.

    Args:
        timeout, folder, rank: the rank's ``stall_timeout``, report folder and rank.
        worker_id: this worker's id in its DataLoader.
    """

    def __init__(self, timeout: float, folder: str, rank: int, worker_id: int) -> None:
        self.timeout, self.folder, self.rank, self.worker_id = timeout, folder, rank, worker_id
        self._main = threading.get_ident()
        self._started = time.time()
        self.poll = min(1.0, max(0.05, timeout / 10))

    def start(self) -> None:
        if self.timeout > 0:
            threading.Thread(target=self._watch, name="basetrainer-stall-worker-watch", daemon=True).start()

    def loading(self) -> Optional[Tuple[int, Any]]:
        """``(id of the fetch frame, the indices it loads)`` when the worker is loading a batch."""
        frame = sys._current_frames().get(self._main)
        while frame is not None:
            if frame.f_code.co_filename.endswith(_FETCH) and frame.f_code.co_name == "fetch":
                return id(frame), frame.f_locals.get("possibly_batched_index")
            frame = frame.f_back
        return None

    def _watch(self) -> None:
        trigger = os.path.join(self.folder, watchdog.TRIGGER)
        current, since = None, time.monotonic()
        while True:
            time.sleep(self.poll)
            now = self.loading()
            key = None if now is None else now[0]
            if key != current:
                current, since = key, time.monotonic()
            if watchdog.announced(trigger, self._started) is not None:
                self.report(now, time.monotonic() - since)
                return

    def report(self, now: Optional[Tuple[int, Any]], seconds: float) -> None:
        name = os.path.join(self.folder, f"stall-rank{self.rank}-worker{self.worker_id}")
        summary = stall_report.summarize(self._main, self.rank, watchdog.PROGRESS, seconds, self.timeout, None)
        summary.update(worker=self.worker_id, loading=None if now is None else _plain(now[1]),
                       loading_s=round(seconds, 1) if now is not None else None)
        try:
            with open(name + ".txt", "w", encoding="utf-8") as f:
                f.write(stall_report.describe_worker(summary) + "\n\nPython stacks of every thread "
                        "(faulthandler; most recent call first):\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            stall_report.write_text(name + ".json", json.dumps(summary, indent=1))
        except OSError:
            pass


def _plain(indices: Any) -> Any:
    """Sample indices as JSON: ints, (index, epoch) pairs as lists; anything else as text."""
    try:
        return json.loads(json.dumps(indices))
    except (TypeError, ValueError):
        return repr(indices)[:500]
