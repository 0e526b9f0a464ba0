"""How long one call takes: the median of timed runs after warm-up, with its spread.

Several contenders (eager PyTorch and the exported formats) are timed *interleaved*: every
round runs each of them once, in turn, so a burst of load from other processes slows all of
them alike instead of favouring whichever ran in a quiet moment. Only the standard library
is used (the original's ``performance()`` needed an undeclared package).
"""
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List


@dataclass(frozen=True)
class Latency:
    """Milliseconds per call: ``median_ms`` and the spread of the timed runs."""
    median_ms: float
    q1_ms: float        # 25th percentile
    q3_ms: float        # 75th percentile
    min_ms: float
    max_ms: float
    runs: int
    batch: int = 1

    @property
    def spread_ms(self) -> float:
        """The interquartile range (q3 - q1)."""
        return self.q3_ms - self.q1_ms

    @property
    def per_sample_ms(self) -> float:
        return self.median_ms / max(1, self.batch)

    def as_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "spread_ms": self.spread_ms}

    def __str__(self) -> str:
        return f"{self.median_ms:.3f} ms (IQR {self.q1_ms:.3f}-{self.q3_ms:.3f}, n={self.runs}, batch {self.batch})"


def summarize(times_ms: List[float], batch: int = 1) -> Latency:
    """The :class:`Latency` of a list of timings in milliseconds."""
    if not times_ms:
        raise ValueError("no timed runs: runs must be at least 1")
    ordered = sorted(times_ms)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return Latency(statistics.median(ordered), q1, q3, ordered[0], ordered[-1], len(ordered), batch)


def _check(runs: int, warmup: int) -> None:
    for name, value in (("runs", runs), ("warmup", warmup)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "runs" else 0):
            raise ValueError(f"{name}={value!r} must be an integer >= {1 if name == 'runs' else 0}")


def measure(fn: Callable[[], Any], runs: int = 20, warmup: int = 3, batch: int = 1) -> Latency:
    """Time ``fn()``: ``warmup`` untimed calls, then ``runs`` timed ones."""
    return interleaved({"fn": fn}, runs, warmup, batch)["fn"]


def interleaved(contenders: Dict[str, Callable[[], Any]], runs: int = 20, warmup: int = 3,
                batch: int = 1, pause_s: float = 0.0) -> Dict[str, Latency]:
    """Time every contender ``runs`` times, one call of each per round, after ``warmup`` rounds.

    ``pause_s``: an untimed pause before each call. Several runtimes keep their worker threads
    spinning for a while after a call (ONNX Runtime, OpenMP's block time: 20 ms in NCNN), which
    would slow whichever contender runs next on a machine with few cores.
    """
    _check(runs, warmup)
    times: Dict[str, List[float]] = {name: [] for name in contenders}
    for _ in range(warmup):
        for fn in contenders.values():
            fn()
    for _ in range(runs):
        for name, fn in contenders.items():
            if pause_s:
                time.sleep(pause_s)
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1000.0)
    return {name: summarize(record, batch) for name, record in times.items()}
