"""The data-stall meter: the share of each train phase that every rank spent waiting for its loader.

The loop (:meth:`~basetrainer.engine.engine.Engine.run_train_epoch`) adds up the wall time spent
inside the train loader's ``next()`` (opening the loader included) with ``time.perf_counter``:
two C calls per step, no torch op and no host sync. At the end of the train phase
:func:`gather` sends each rank's two sums to every rank (one small collective per epoch), and
rank 0 logs one line of advice when a rank waited more than ``data_wait_warn`` of the phase.

What it measures is the CPU's wait: on CUDA the compute is asynchronous, so the time after
``next()`` returns is the time to *queue* the step's work, and a wait in ``next()`` may overlap
GPU work still queued. The share is then an upper bound of the GPU's idle time for data; a
large one still means the loader, not the model, sets the pace.
"""
import logging
from typing import Any, Dict, List, Optional

from basetrainer.runtime import comm

logger = logging.getLogger(__name__)

# the keys of LogHistory's row (history.csv, TensorBoard, trackers)
FIGURES = ("data_wait", "data_wait_mean", "data_wait_rank")


class DataWait:
    """One train phase's meter, every rank's share.

    Attributes:
        epoch: the epoch (0-based).
        waited: seconds each rank spent inside its train loader's ``next()``, by rank.
        seconds: each rank's wall time of the train phase, by rank.
        workers: each rank's ``num_workers`` (None for a loader without one), by rank.
    """

    def __init__(self, epoch: int, waited: List[float], seconds: List[float], workers: List[Optional[int]]) -> None:
        self.epoch, self.waited, self.seconds, self.workers = epoch, waited, seconds, workers

    @property
    def shares(self) -> List[float]:
        """The share of the train phase each rank waited for data, a fraction in [0, 1], by rank."""
        return [min(1.0, w / s) if s > 0 else 0.0 for w, s in zip(self.waited, self.seconds)]

    @property
    def slowest(self) -> int:
        """The rank that waited the largest share (the lowest such rank)."""
        shares = self.shares
        return shares.index(max(shares))

    def figures(self) -> Dict[str, float]:
        """``data_wait``: the largest share over the ranks (the rank that sets the pace);
        ``data_wait_mean``: the mean over the ranks; ``data_wait_rank``: the rank of the largest."""
        shares = self.shares
        return {"data_wait": max(shares), "data_wait_mean": sum(shares) / len(shares),
                "data_wait_rank": self.slowest}

    def text(self) -> str:
        """``data wait 12%`` in one process, ``data wait 21% (max rank 1: 41%)`` (the mean, then
        the largest) over several."""
        shares = self.shares
        if len(shares) == 1:
            return f"data wait {shares[0]:.0%}"
        return f"data wait {sum(shares) / len(shares):.0%} (max rank {self.slowest}: {max(shares):.0%})"

    def advice(self, threshold: float) -> Optional[str]:
        """One line naming every rank that waited more than ``threshold`` (0: never), or None."""
        if not threshold:
            return None
        over = [(rank, share) for rank, share in enumerate(self.shares) if share > threshold]
        if not over:
            return None
        ranks = ", ".join(str(rank) for rank, _ in over)
        shares = ", ".join(f"{share:.0%}".replace("%", " %") for _, share in over)
        workers = self.workers[over[0][0]]
        fix = (f"raise num_workers (now {workers}) or make the dataset's __getitem__ cheaper" if workers is not None
               else "make the train loader faster (more worker processes, a cheaper __getitem__)")
        return (f"rank{'s' if len(over) > 1 else ''} {ranks} waited {shares} of epoch {self.epoch}'s training "
                f"for data: {fix} (this line: a wait over data_wait_warn = {threshold:.0%})")


def gather(epoch: int, waited: float, seconds: float, loader: Any, threshold: float) -> DataWait:
    """Every rank's meter of this train phase (one collective), and rank 0's advice logged.

    Args:
        epoch: the epoch.
        waited: seconds this rank spent inside the train loader's ``next()``.
        seconds: this rank's wall time of the train phase.
        loader: this rank's train loader (for its ``num_workers``).
        threshold: the share above which rank 0 logs one line of advice (0: never).

    Returns:
        The :class:`DataWait` of the phase, the same on every rank.
    """
    workers = getattr(loader, "num_workers", None)
    mine = (float(waited), float(seconds), workers if isinstance(workers, int) else None)
    every = comm.all_gather_object(mine)
    meter = DataWait(epoch, [w for w, _, _ in every], [s for _, s, _ in every], [k for _, _, k in every])
    line = meter.advice(threshold) if comm.is_main_process() else None
    if line:
        logger.warning(line)
    return meter
