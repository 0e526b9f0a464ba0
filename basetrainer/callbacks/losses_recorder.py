"""Sample-weighted loss figures, kept on the device and reduced across ranks."""
from typing import Any, Dict, List, Optional, Tuple

import torch

from basetrainer.callbacks.callbacks import batch_size_of
from basetrainer.callbacks.recorder import Recorder, sum_over_ranks
from basetrainer.runtime import comm


class RunningSums:
    """Named running sums on the device, plus a sample count on the host: the counts of a
    mean (losses, a function's values).

    ``add`` launches no host sync; ``means`` reads the sums (one sync) and, with
    ``reduce=True``, sums them over every rank first, so the figure is the whole data set's.
    """

    _COUNT = "\0count"   # the sample count's key among the sums when they are reduced

    def __init__(self) -> None:
        self.sums: Dict[str, torch.Tensor] = {}
        self.count = 0
        self._loaded = False   # sums restored on the CPU: moved to the device of the next values

    def reset(self) -> None:
        self.sums, self.count, self._loaded = {}, 0, False

    def add(self, values: Dict[str, torch.Tensor], n: int, per_sample: bool = True) -> None:
        """Add ``value x n`` per key (``per_sample=False``: values are already sums over the
        ``n`` samples) and ``n`` samples."""
        alpha = n if per_sample else 1
        sums = self.sums
        if self._loaded and values:   # restored from a checkpoint on the CPU
            self._loaded = False
            device = next(iter(values.values())).device
            self.sums = sums = {k: v.to(device) for k, v in sums.items()}
        for key, value in values.items():
            prev = sums.get(key)
            if prev is None:
                sums[key] = value.detach().float() * alpha   # a new tensor: never the loss itself
            else:
                prev.add_(value.detach(), alpha=alpha)
        self.count += n

    def totals(self, reduce: bool = False) -> Tuple[Dict[str, float], float]:
        """``({key: sum}, samples)``, summed over every rank when ``reduce`` (one host sync)."""
        if not self.sums and not (reduce and comm.get_world_size() > 1):
            return {}, float(self.count)
        device = next(iter(self.sums.values())).device if self.sums else torch.device("cpu")
        sums = dict(self.sums)
        sums[self._COUNT] = torch.tensor(float(self.count), device=device)
        if reduce:   # a rank may have seen no batch (and no key)
            sums, _ = sum_over_ranks(sums)
        count = sums.pop(self._COUNT)
        keys = sorted(sums)
        if not keys:
            return {}, float(self.count)
        device = sums[keys[0]].device
        values = torch.stack([sums[k].reshape(()).to(device) for k in keys] + [count.to(device)]).tolist()
        return dict(zip(keys, values[:-1])), values[-1]

    def means(self, reduce: bool = False) -> Dict[str, float]:
        """``{key: sum / samples}`` (NaN with no sample), over every rank when ``reduce``."""
        sums, count = self.totals(reduce)
        return {k: (v / count if count else float("nan")) for k, v in sums.items()}

    def saved(self) -> Dict[str, Any]:
        """Every rank's sums and samples so far (a collective), as a checkpoint holds them."""
        sums, count = self.totals(reduce=True)
        return {"sums": sums, "count": count}

    def restore(self, saved: Dict[str, Any]) -> None:
        """Start from saved totals (moved to the device of the first values added)."""
        self.sums = {k: torch.tensor(float(v), dtype=torch.float32) for k, v in saved["sums"].items()}
        self.count = int(round(saved["count"]))
        self._loaded = bool(self.sums)


def loss_parts(losses: Any, total_name: str) -> Dict[str, torch.Tensor]:
    """``{total_name: total}`` plus one entry per named part of a dict of losses."""
    if isinstance(losses, torch.Tensor):
        return {total_name: losses}
    if isinstance(losses, dict):
        parts = {str(k): v for k, v in losses.items()}
        total = sum(list(parts.values())[1:], list(parts.values())[0])
        return {**parts, total_name: total}
    if isinstance(losses, (list, tuple)):
        parts = {f"{total_name}{i}": v for i, v in enumerate(losses)}
        return {**parts, total_name: sum(losses[1:], losses[0])}
    raise TypeError(f"losses must be a tensor, tuple or dict of tensors, got {type(losses).__name__}")


class LossesRecorder(Recorder):
    """Writes ``logs["train/<indicator>"]`` and ``logs["test/<indicator>"]``: the loss of the
    epoch as a sample-weighted mean (sum of loss x batch size over the epoch / number of
    samples), reduced over every process. Every ``log_freq`` steps the running train figure of
    this process is published too.

    Args:
        indicator: the name of the figure (default ``"loss"``).
    """

    parts = False  # MultiLossesRecorder records each part of a dict of losses too

    def __init__(self, indicator: str = "loss") -> None:
        super().__init__(indicator)

    def new_counts(self, phase: str) -> RunningSums:
        return RunningSums()

    def update(self, counts: RunningSums, inputs: Any, outputs: Any, losses: Any) -> None:
        if isinstance(losses, torch.Tensor):
            values = {self.indicator: losses}
        else:
            values = loss_parts(losses, self.indicator)
            values = values if self.parts else {self.indicator: values[self.indicator]}
        counts.add(values, batch_size_of(inputs),
                   per_sample=getattr(self.trainer, "loss_reduction", "mean") != "sum")

    def figures(self) -> Optional[List[str]]:
        # the parts of a dict of losses are known only from the first step's losses
        return None if self.parts else [self.indicator]

    def compute(self, counts: RunningSums, reduce: bool) -> Dict[str, float]:
        sums, count = counts.totals(reduce)   # RunningSums.means, one call fewer at each log step
        return {k: (v / count if count else float("nan")) for k, v in sums.items()}
