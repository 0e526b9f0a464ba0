"""The one skeleton of every recorder, :class:`Recorder`, and the one place where a recorder's
counts are reduced over the ranks, :func:`sum_over_ranks`.

A recorder resets its counts when an epoch (train) or the test phase begins, updates them each
step on the device (no host sync), publishes the running train figure of this process every
``log_freq`` steps, reduces the counts over every rank when a phase ends (so every callback
sees the whole data set's figures in ``on_epoch_end``), and saves the train phase's counts of
every rank in a mid-epoch checkpoint, under a stable name, so a resumed epoch counts each step
once. A subclass states only what it counts.

Why the reduction is our own and not torchmetrics' ``Metric.sync()``/``unsync()``:
torchmetrics is an optional extra (losses and accuracy must reduce without it), and its sync is
not exact on the shards exact sharding makes. Measured with torchmetrics 1.9.0, 2 gloo ranks,
one of them holding fewer batches (or none): ``MeanAbsoluteError`` and ``MulticlassAUROC``
(sum and cat states) agree with one process; a ``CatMetric`` holding one 0-d value on one rank
and nothing on the other aborts in gloo (mismatched collectives); ``ExplainedVariance`` with
an idle rank (its summed states keep their scalar defaults there) aborts; a list state with
``dist_reduce_fx=None`` of 3 items on one rank and 2 on the other hangs (one all_gather per
item); a ``"mean"`` state with an idle rank gives 2.0 where one process gives 4.0 (the idle
rank's default is averaged in). Here a rank that saw no batch adds nothing, shapes are agreed
from the ranks that have them, and the sums travel in one ``all_reduce`` per dtype (integer
counts stay exact), after one ``all_gather_object`` of their shapes and of what is not summed.
"""
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from basetrainer.callbacks.callbacks import Callback
from basetrainer.runtime import comm

PHASES = ("train", "test")


def check_phases(phases: Sequence[str]) -> Tuple[str, ...]:
    """``phases`` as a tuple of ``"train"``/``"test"`` (a single string is one phase).

    Raises:
        ValueError: no phase, or one of another name.
    """
    if isinstance(phases, str):
        phases = (phases,)
    phases = tuple(phases)
    if not phases or any(p not in PHASES for p in phases):
        raise ValueError(f"phases={phases!r}: choose one or both of {PHASES}")
    return phases


def sum_over_ranks(sums: Dict[str, Optional[torch.Tensor]], shared: Any = None,
                   agreed: bool = False) -> Tuple[Dict[str, torch.Tensor], List[Any]]:
    """Every rank's ``sums`` added up, and every rank's ``shared`` object, in rank order.

    A collective: every rank calls it, also one that saw no batch. A key that is None or
    missing on a rank (it counted nothing) adds zeros of the shape the other ranks agree on; a
    key no rank holds is left out. One ``all_gather_object`` (shapes, dtypes and ``shared``)
    and one ``all_reduce`` per dtype. In one process: the tensors as they are, ``[shared]``.

    Args:
        sums: named tensors to add over the ranks (any device, shape and dtype).
        shared: a picklable object gathered from every rank beside them.
        agreed: every rank passes every key, with the same shape and dtype, and ``shared`` is
            None: the shapes are not gathered (one collective fewer).

    Returns:
        ``({key: summed tensor, on the device it came from}, [shared of rank 0, rank 1, ...])``.

    Raises:
        ValueError: a key has different shapes or dtypes on different ranks.
    """
    present = {k: v for k, v in sums.items() if v is not None}
    if comm.get_world_size() == 1:
        return present, [shared]
    if agreed:
        kinds = {k: (tuple(v.shape), v.dtype) for k, v in present.items()}
        ranks = [shared] * comm.get_world_size()
    else:
        gathered = comm.all_gather_object(({k: (tuple(v.shape), v.dtype) for k, v in present.items()}, shared))
        ranks = [s for _, s in gathered]
        seen: Dict[str, set] = {}
        for meta, _ in gathered:
            for key, kind in meta.items():
                seen.setdefault(key, set()).add(kind)
        for key, options in seen.items():
            if len(options) > 1:
                raise ValueError(f"summed state {key!r} has shapes/dtypes {sorted(map(str, options))} on different "
                                 f"ranks; a state summed over ranks needs one shape (e.g. set the metric's num_classes)")
        kinds = {key: options.pop() for key, options in seen.items()}
    device = next(iter(present.values())).device if present else None
    by_dtype: Dict[torch.dtype, List[str]] = {}
    for key in sorted(kinds):   # the same order on every rank
        by_dtype.setdefault(kinds[key][1], []).append(key)
    out: Dict[str, torch.Tensor] = {}
    for dtype, keys in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        parts = [present[k].reshape(-1) if k in present else torch.zeros(kinds[k][0], dtype=dtype).reshape(-1)
                 for k in keys]
        place = device or parts[0].device
        packed = comm.all_reduce_sum(torch.cat([p.to(place) for p in parts]))
        offset = 0
        for key in keys:
            shape = kinds[key][0]
            n = int(torch.Size(shape).numel())
            value = packed[offset: offset + n].reshape(shape)
            out[key] = value.to(present[key].device) if key in present else value
            offset += n
    return out, ranks


class Recorder(Callback):
    """The base of the recorders: it writes ``logs["train/<name>"]`` and ``logs["test/<name>"]``
    for each figure :meth:`compute` returns, reduced over every rank when the phase ends.

    A subclass states what it counts:

    - :meth:`new_counts` makes one phase's counts (``self.train``, ``self.test``): anything
      with a ``reset()``;
    - :meth:`update` adds one step to them, on the device, with no host sync;
    - :meth:`compute` gives the figures, with ``reduce=True`` over every rank (a collective);
    - :meth:`saved` and :meth:`restore` give and take the counts of every rank so far, for a
      checkpoint inside an epoch (by default the counts' own ``saved()``/``restore()``, as
      :class:`~basetrainer.callbacks.losses_recorder.RunningSums` has them).

    The rest is here once: the events, the running train figure every ``log_freq`` steps (this
    process's, no collective), the phase-end figures, and the checkpoint state keyed by
    :attr:`state_key` (the class name, or :attr:`state_name`, and the indicator). A resumed
    epoch goes on from the saved counts, carried by rank 0, so each step counts once.

    Args:
        indicator: the figure's name (the recorder's, when it writes several figures).
        phases: the phases recorded, ``"train"`` and/or ``"test"``.

    Example::

        from basetrainer.callbacks.losses_recorder import RunningSums

        class MeanAbsError(Recorder):     # mean |output - target|, sample-weighted, exact over ranks
            def new_counts(self, phase):
                return RunningSums()
            def update(self, counts, inputs, outputs, losses):
                counts.add({self.indicator: (outputs[:, 0] - inputs[1]).abs().sum()}, len(inputs[1]),
                           per_sample=False)
            def compute(self, counts, reduce):
                return counts.means(reduce)
    """

    #: the name of the state in a checkpoint (before ``:<indicator>``); None: the class name
    state_name: Optional[str] = None

    def __init__(self, indicator: str, phases: Sequence[str] = PHASES) -> None:
        super().__init__()
        self.indicator = indicator
        self.phases = check_phases(phases)
        self.train = self.new_counts("train")
        self.test = self.new_counts("test")
        self._partial: Optional[Dict[str, Any]] = None   # all ranks' train counts so far, to save
        self._resumed = False

    # ---------------------------------------------------------------- what a recorder states
    def new_counts(self, phase: str) -> Any:
        """Empty counts for ``phase`` (``"train"`` or ``"test"``): an object with ``reset()``."""
        raise NotImplementedError(f"{type(self).__name__} must define new_counts(phase)")

    def update(self, counts: Any, inputs: Any, outputs: Any, losses: Any) -> None:
        """Add one step (the batch ``inputs``, the model's ``outputs``, the ``losses``) to ``counts``."""
        raise NotImplementedError(f"{type(self).__name__} must define update(counts, inputs, outputs, losses)")

    def compute(self, counts: Any, reduce: bool) -> Dict[str, Any]:
        """The figures of ``counts``, ``{name: value}``; ``reduce``: over every rank (every rank calls it)."""
        raise NotImplementedError(f"{type(self).__name__} must define compute(counts, reduce)")

    def figures(self) -> Optional[List[str]]:
        """The names of the figures :meth:`compute` gives, known before the run (each is written
        as ``"<phase>/<name>"`` for the phases :meth:`records`); None when only the run tells
        (the default: a subclass's ``compute`` decides). A search checks its objective against
        them before any trial runs."""
        return None

    def saved(self, counts: Any) -> Optional[Dict[str, Any]]:
        """What a checkpoint saves of ``counts``: every rank's counts so far, summed (every rank
        calls it); None when there is nothing to save."""
        return counts.saved()

    def restore(self, counts: Any, saved: Dict[str, Any]) -> None:
        """Start ``counts`` from what :meth:`saved` returned."""
        counts.restore(saved)

    def publish(self, phase: str, figures: Dict[str, Any], logs: Optional[dict]) -> None:
        """Write ``figures`` to ``logs`` as ``"<phase>/<name>"``."""
        if logs is None:
            return
        for key, value in figures.items():
            logs[f"{phase}/{key}"] = value

    def records(self, phase: str) -> bool:
        """Whether ``phase``'s figures are due at its end: it is recorded and the trainer has its loader."""
        return phase in self.phases and (self.trainer is None or
                                         getattr(self.trainer, f"{phase}_loader", True) is not None)

    # ---------------------------------------------------------------- a resume inside an epoch
    @property
    def state_key(self) -> str:
        return f"{self.state_name or type(self).__name__}:{self.indicator}"

    def prepare_state(self) -> None:
        # every rank, before a checkpoint: the epoch's counts so far over all ranks (they add up)
        self._partial = None
        if "train" in self.phases and self.trainer is not None and getattr(self.trainer, "phase", None) == "train":
            self._partial = self.saved(self.train)

    def state_dict(self) -> Dict[str, Any]:
        return {"train": self._partial} if self._partial else {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        partial = state.get("train")
        self.train.reset()
        if partial and comm.get_rank() == 0:   # rank 0 carries every rank's counts so far
            self.restore(self.train, partial)
        self._resumed = bool(partial)

    # ---------------------------------------------------------------- events
    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        if self._resumed:   # the resumed epoch goes on from its saved counts
            self._resumed = False
            return
        self.train.reset()

    def on_train_summary(self, inputs: Any, outputs: Any, losses: Any, epoch: int, batch: int,
                         logs: Optional[dict] = None) -> None:
        if "train" not in self.phases:
            return
        self.update(self.train, inputs, outputs, losses)
        if self.trainer is not None and self.trainer.should_log(batch):   # this rank's figure, no collective
            self.publish("train", self.compute(self.train, False), logs)

    def on_test_begin(self, logs: Optional[dict] = None) -> None:
        if self.records("train"):
            self.publish("train", self.compute(self.train, True), logs)
        self.test.reset()

    def on_test_summary(self, inputs: Any, outputs: Any, losses: Any, epoch: int, batch: int,
                        logs: Optional[dict] = None) -> None:
        if "test" in self.phases:
            self.update(self.test, inputs, outputs, losses)

    def on_test_end(self, logs: Optional[dict] = None) -> None:
        if self.records("test"):
            self.publish("test", self.compute(self.test, True), logs)
