"""Sample-weighted loss figures, kept on the device and reduced across ranks."""
from typing import Any, Dict, Optional, Tuple

import torch

from basetrainer.callbacks.callbacks import Callback, batch_size_of
from basetrainer.runtime import comm


class RunningSums:
    """Named running sums on the device, plus a sample count on the host.

    ``add`` launches no host sync; ``means`` reads the sums (one sync) and, with
    ``reduce=True``, sums them over every rank first, so the figure is the whole data set's.
    """

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
        keys = sorted(self.sums)
        if reduce and comm.get_world_size() > 1:  # a rank may have seen no batch (and no key)
            keys = sorted(set().union(*comm.all_gather_object(keys)))
        if not keys:
            return {}, float(self.count)
        device = next(iter(self.sums.values())).device if self.sums else torch.device("cpu")
        zero = torch.zeros((), device=device)
        packed = torch.stack([self.sums.get(k, zero).reshape(()).to(device) for k in keys] +
                             [torch.tensor(float(self.count), device=device)])
        if reduce:
            packed = comm.all_reduce_sum(packed)
        values = packed.tolist()
        return dict(zip(keys, values[:-1])), values[-1]

    def means(self, reduce: bool = False) -> Dict[str, float]:
        sums, count = self.totals(reduce)
        return {k: (v / count if count else float("nan")) for k, v in sums.items()}

    def load(self, sums: Dict[str, float], count: float) -> None:
        """Start from saved totals (moved to the device of the first values added)."""
        self.sums = {k: torch.tensor(float(v), dtype=torch.float32) for k, v in sums.items()}
        self.count = int(round(count))
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


class LossesRecorder(Callback):
    """Writes ``logs["train/<indicator>"]`` and ``logs["test/<indicator>"]``: the loss of the
    epoch as a sample-weighted mean (sum of loss x batch size over the epoch / number of
    samples), reduced over every process. Every ``log_freq`` steps the running train figure of
    this process is published too.

    Args:
        indicator: the name of the figure (default ``"loss"``).
    """

    parts = False  # MultiLossesRecorder records each part of a dict of losses too

    def __init__(self, indicator: str = "loss") -> None:
        super().__init__()
        self.indicator = indicator
        self.train = RunningSums()
        self.test = RunningSums()
        self._partial: Optional[Dict[str, Any]] = None   # all ranks' sums of the epoch so far, to save
        self._resumed = False

    @property
    def state_key(self) -> str:
        return f"{type(self).__name__}:{self.indicator}"

    def _values(self, losses: Any) -> Dict[str, torch.Tensor]:
        if isinstance(losses, torch.Tensor):
            return {self.indicator: losses}
        values = loss_parts(losses, self.indicator)
        return values if self.parts else {self.indicator: values[self.indicator]}

    def _publish(self, phase: str, sums: RunningSums, logs: Optional[dict], reduce: bool) -> None:
        if logs is None:
            return
        for key, value in sums.means(reduce=reduce).items():
            logs[f"{phase}/{key}"] = value

    # ---------------------------------------------------------------- a resume inside an epoch
    def prepare_state(self) -> None:
        # every rank, before a checkpoint: the epoch's partial sums of all ranks (they add up)
        self._partial = None
        if self.trainer is not None and getattr(self.trainer, "phase", None) == "train":
            sums, count = self.train.totals(reduce=True)
            self._partial = {"sums": sums, "count": count}

    def state_dict(self) -> Dict[str, Any]:
        return {"train": self._partial} if self._partial else {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        partial = state.get("train")
        self.train.reset()
        if partial and comm.get_rank() == 0:   # rank 0 carries every rank's part of the epoch so far
            self.train.load(partial["sums"], partial["count"])
        self._resumed = bool(partial)

    # ---------------------------------------------------------------- events
    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        if self._resumed:   # the resumed epoch goes on from its saved sums
            self._resumed = False
            return
        self.train.reset()

    def on_train_summary(self, inputs: Any, outputs: Any, losses: Any, epoch: int, batch: int,
                         logs: Optional[dict] = None) -> None:
        self.train.add(self._values(losses), batch_size_of(inputs),
                       per_sample=getattr(self.trainer, "loss_reduction", "mean") != "sum")
        if self.trainer is not None and self.trainer.should_log(batch):
            self._publish("train", self.train, logs, reduce=False)

    def on_test_begin(self, logs: Optional[dict] = None) -> None:
        self._publish("train", self.train, logs, reduce=True)
        self.test.reset()

    def on_test_summary(self, inputs: Any, outputs: Any, losses: Any, epoch: int, batch: int,
                        logs: Optional[dict] = None) -> None:
        self.test.add(self._values(losses), batch_size_of(inputs),
                      per_sample=getattr(self.trainer, "loss_reduction", "mean") != "sum")

    def on_test_end(self, logs: Optional[dict] = None) -> None:
        if self.trainer is None or self.trainer.test_loader is not None:
            self._publish("test", self.test, logs, reduce=True)
