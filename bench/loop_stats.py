"""What ``bench_loop.py`` reads and how it summarises it: CPU time of a process and its workers,
and paired medians with bootstrap 95% intervals.

CPU time, not wall time, is the figure a busy machine disturbs least: other jobs on the same
cores stretch a run's wall time but not the CPU time the run itself uses (they still cost it
some through shared caches, so CPU figures are steadier, not noise-free).
"""
import os
import random
import resource
import statistics
import time
from typing import Dict, List, Sequence, Tuple

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _children_cpu(parent: int) -> float:
    """CPU seconds of ``parent``'s live child processes (from /proc; 1/CLK_TCK resolution)."""
    total = 0.0
    try:
        names = os.listdir("/proc")
    except OSError:
        return 0.0
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:           # ppid
            total += (int(fields[11]) + int(fields[12])) / _TICK   # utime + stime
    return total


def cpu_seconds(children: bool = False) -> float:
    """CPU time used so far by this process (every thread: intra-op threads, background writer
    and logger threads) and, with ``children``, by its child processes (DataLoader workers):
    live ones from /proc, ended and waited-for ones from ``getrusage(RUSAGE_CHILDREN)``."""
    total = time.process_time()
    if children:
        ended = resource.getrusage(resource.RUSAGE_CHILDREN)
        total += ended.ru_utime + ended.ru_stime + _children_cpu(os.getpid())
    return total


def clock(children: bool = False) -> Tuple[float, float]:
    """``(wall, cpu)`` seconds now."""
    return time.perf_counter(), cpu_seconds(children)


def bootstrap_median(values: Sequence[float], resamples: int = 4000, seed: int = 0) -> Tuple[float, float, float]:
    """The median of ``values`` and a bootstrap 95% interval of it (percentiles 2.5 and 97.5 of
    the medians of ``resamples`` resamples with replacement; seeded, so a render is repeatable)."""
    values = list(values)
    if not values:
        return float("nan"), float("nan"), float("nan")
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    return statistics.median(values), medians[int(0.025 * (resamples - 1))], medians[int(0.975 * (resamples - 1))]


def paired(b: Sequence[float], h: Sequence[float], steps: int) -> Dict[str, float]:
    """Paired figures of runs ``b`` (basetrainer) and ``h`` (hand loop), seconds per epoch:
    the median ratio b/h and the median overhead (b - h) per step in microseconds, each with its
    bootstrap 95% interval, and the range of the ratios."""
    ratios = [x / y for x, y in zip(b, h)]
    overheads = [(x - y) / steps * 1e6 for x, y in zip(b, h)]
    r, r_lo, r_hi = bootstrap_median(ratios)
    o, o_lo, o_hi = bootstrap_median(overheads)
    return {"ratio": r, "ratio_lo": r_lo, "ratio_hi": r_hi, "overhead_us": o, "overhead_lo": o_lo,
            "overhead_hi": o_hi, "min": min(ratios), "max": max(ratios), "pairs": len(ratios)}


def per_step_us(runs: List[float], steps: int) -> float:
    """The median run, in microseconds per step."""
    return statistics.median(runs) / steps * 1e6
