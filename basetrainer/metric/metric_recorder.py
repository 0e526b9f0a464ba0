"""Recorders for any task: :class:`MetricRecorder` wraps a torchmetrics ``Metric`` or
``MetricCollection``; :class:`FunctionRecorder` averages a plain function of (outputs, targets).

Both write ``logs["train/<name>"]`` and ``logs["test/<name>"]`` like the built-in recorders:
updated on the model's device with no host sync per step, the running train figure (this
process's) read every ``log_freq`` steps, the epoch's figures reduced over every process at the
phase end (exact for data sets that do not divide by the ranks), and the train phase's partial
state saved in mid-epoch checkpoints. torchmetrics is imported only when a MetricRecorder is
built.
"""
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from basetrainer.callbacks.callbacks import batch_size_of
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.recorder import PHASES, Recorder, check_phases
from basetrainer.metric.recorder_inputs import pick_output, pick_targets, update_driver, update_error
from basetrainer.runtime import comm
from basetrainer.runtime.errors import MissingExtraError

INSTALL = 'pip install "basetrainer[metrics]"'


def _figures(name: str, value: Any, per_class: bool) -> Dict[str, Any]:
    """A computed value as flat figures (tensors still; read with one sync by the caller).

    A scalar is ``name``; a dict gives ``name_<key>`` per entry (the rule again for each); a
    tensor of several values (e.g. per-class IoU) gives its mean over the entries that are not
    NaN as ``name`` and, with ``per_class``, ``name_<i>`` per entry.
    """
    if isinstance(value, dict):
        out: Dict[str, Any] = {}
        for key, v in value.items():
            out.update(_figures(f"{name}_{key}" if name else str(key), v, per_class))
        return out
    if not isinstance(value, torch.Tensor):
        return {name: value}
    if value.numel() == 1:
        return {name: value.reshape(())}
    if not value.is_floating_point():   # ids or counts (e.g. a detection metric's "classes"): no figure
        return {}
    flat = value.reshape(-1).float()
    out = {name: flat.nanmean()}
    if per_class:
        out.update({f"{name}_{i}": v for i, v in enumerate(flat)})
    return out


class MetricRecorder(Recorder):
    """Writes a torchmetrics metric's figure as ``logs["train/<indicator>"]`` and
    ``logs["test/<indicator>"]``; a ``MetricCollection`` writes one figure per member,
    ``"<phase>/<member name>"`` (the collection's prefix/postfix included).

    The metric is updated on the model's device with no host sync added per step (torchmetrics'
    own input checks may sync: build classification metrics with ``validate_args=False`` for the
    fastest loop). The running train figure is this process's, read every ``log_freq`` steps;
    each phase's figure is over the whole epoch and every process: the states are reduced by
    their ``dist_reduce_fx`` once, at the phase end (torchmetrics' own sync is turned off, since
    it is a collective inside ``compute()`` and ranks hold different numbers of test batches).

    A computed value that is not one number follows one rule: a dict gives ``<name>_<key>`` per
    entry; a tensor of several values (e.g. ``JaccardIndex(average=None)``, IoU per class) gives
    its mean over the non-NaN entries as ``<name>`` and, with ``per_class=True``, ``<name>_<i>``.

    ``higher_is_better`` (torchmetrics') tells ModelCheckpoint and EarlyStopping which way is
    better when they are given this recorder's figure and no ``mode``.

    Args:
        metric: a ``torchmetrics.Metric`` or ``MetricCollection`` (needs ``pip install "basetrainer[metrics]"``).
        indicator: the figure's name (default: the metric's class name); for a collection it
            only names the recorder (its figures take the members' names).
        phases: the phases recorded, ``"train"`` and/or ``"test"``.
        target_key: the key of the targets in dict batches (default: the batch's second part,
            or its ``targets``/``target``/``labels``/``label``).
        output_key: the key of dict outputs; without it, a dict's ``"logits"``, else ``"out"``,
            else its only entry (several others: a ValueError asking for ``output_key``); tuple
            or list outputs give their first element (docs/metrics.md, "What a recorder reads").
        transform: ``transform(outputs, targets)`` returns what the metric's update takes: a
            pair for a ``(preds, target)`` metric (e.g. ``lambda o, t: (o.argmax(1), t)``), one
            value for a one-input metric (``lambda o, t: (o - t).abs()``), a tuple of its
            arguments otherwise (``(value, weight)`` for ``MeanMetric``, ``(preds, target,
            indexes)`` for retrieval metrics).
        per_class: also write each entry of a value with several entries.
        reads: give the update one input, ``"outputs"`` or ``"targets"`` (default: both,
            ``(outputs, targets)``; for torchmetrics' aggregators ``MeanMetric``, ``MaxMetric``,
            ``MinMetric``, ``SumMetric``, ``CatMetric``: the outputs).

    What the update gets is chosen, never read from its parameters: ``transform``'s return, else
    the input ``reads`` names, else ``(outputs, targets)`` (the outputs alone for an aggregator).
    An update that does not take the inputs chosen is refused when the recorder is built, with
    the fix named (``reads=`` or ``transform=``); a transform's return the update does not take,
    at the first step. A collection's members get the same inputs.

    Example::

        from torchmetrics.regression import MeanAbsoluteError
        callbacks = [MetricRecorder(MeanAbsoluteError(), indicator="MAE"),
                     ModelCheckpoint(model_dir=..., indicator="MAE")]   # mode "min", from the metric
        MetricRecorder(MeanMetric(), "mean_score")                      # the mean of the outputs
        MetricRecorder(MaxMetric(), "max_label", reads="targets")
    """

    state_name = "MetricRecorder"

    def __init__(self, metric: Any, indicator: Optional[str] = None, phases: Sequence[str] = PHASES,
                 target_key: Optional[str] = None, output_key: Optional[str] = None,
                 transform: Optional[Callable[[Any, Any], Any]] = None, per_class: bool = False,
                 reads: Optional[str] = None) -> None:
        try:
            import torchmetrics
        except ImportError as e:
            raise MissingExtraError(f"MetricRecorder needs torchmetrics: {INSTALL}") from e
        from basetrainer.metric import metric_states

        self.collection = isinstance(metric, torchmetrics.MetricCollection)
        if not isinstance(metric, (torchmetrics.Metric, torchmetrics.MetricCollection)):
            raise TypeError(f"metric={metric!r} is a {type(metric).__name__}; MetricRecorder takes a torchmetrics "
                            f"Metric or MetricCollection (for a plain function use FunctionRecorder)")
        if indicator is None:
            indicator = "+".join(map(str, metric.keys())) if self.collection else type(metric).__name__
        if not isinstance(indicator, str) or not indicator.strip():
            raise ValueError(f"indicator={indicator!r} must be a non-empty name (the figure's logs key; for a "
                             f"collection, the recorder's name): e.g. indicator={type(metric).__name__!r}")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform={transform!r} must be callable: transform(outputs, targets) returns what "
                            f"the metric's update takes")
        metric_states.check_reducible(metric)
        self._args = update_driver(metric_states.members(metric), f"MetricRecorder {indicator!r}", reads, transform)
        self.target_key, self.output_key, self.transform, self.reads = target_key, output_key, transform, reads
        self._label = f"MetricRecorder {indicator!r}"
        self.per_class = per_class
        metric_states.local_only(metric)   # no collective inside compute()/forward()
        self.metrics = {"train": metric}
        super().__init__(indicator, phases)
        self.metrics["test"] = self.test

    # ---------------------------------------------------------------- which way is better
    @property
    def higher_is_better(self) -> Any:
        """torchmetrics' ``higher_is_better`` (None when it does not say); for a collection a
        dict ``{member name: higher_is_better}``."""
        metric = self.metrics["train"]
        if self.collection:
            return {str(k): getattr(m, "higher_is_better", None) for k, m in metric.items(keep_base=False, copy_state=False)}
        return getattr(metric, "higher_is_better", None)

    def mode_of(self, key: str) -> Optional[str]:
        """``"max"``/``"min"`` for a ``logs`` key this recorder writes (``"test/MAE"``, or a
        dict/per-class entry ``"test/MAE_..."``); None for other keys or when the metric does not say."""
        phase, _, name = key.rpartition("/")
        if phase not in self.phases:
            return None
        better = self.higher_is_better
        table = better if isinstance(better, dict) else {self.indicator: better}
        for published, higher in sorted(table.items(), key=lambda kv: -len(kv[0])):
            if higher is not None and (name == published or name.startswith(published + "_")):
                return "max" if higher else "min"
        return None

    # ---------------------------------------------------------------- what it counts
    def new_counts(self, phase: str) -> Any:
        metric = self.metrics["train"]   # the metric given is the train phase's; the test phase's a copy
        return metric if phase == "train" else metric.clone()

    def update(self, counts: Any, inputs: Any, outputs: Any, losses: Any) -> None:
        preds = pick_output(outputs, self.output_key, self._label)
        targets = pick_targets(inputs, self.target_key)
        if isinstance(preds, torch.Tensor):
            preds = preds.detach()
        args = self._args(preds, targets)
        try:
            counts.update(*args)
        except TypeError as e:
            raise update_error(f"MetricRecorder {self.indicator!r}", counts, args, self.transform is not None, e) from e

    def compute(self, counts: Any, reduce: bool) -> Dict[str, float]:
        from basetrainer.metric import metric_states

        if not reduce or comm.get_world_size() == 1:   # the local states (one process: the whole epoch's)
            if reduce and not any(m.update_count for _, m in metric_states.members(counts)):
                return {}
            value = counts.compute()
        else:
            reduced = metric_states.reduce_states(counts)   # every rank, also one that saw no batch
            if all(part["count"] == 0 for part in reduced.values()):
                return {}   # no sample (e.g. resumed at the test phase)
            value = metric_states.compute_reduced(counts, reduced)
        if not self.collection and isinstance(value, torch.Tensor) and value.numel() == 1:
            return {self.indicator: float(value.detach().float())}   # one figure: one host sync
        figures = _figures("" if self.collection else self.indicator, value, self.per_class)
        tensors = [v for v in figures.values() if isinstance(v, torch.Tensor)]
        if tensors:   # one host sync for every figure
            device = tensors[0].device
            numbers = iter(torch.stack([t.detach().float().to(device) for t in tensors]).tolist())
        return {key: next(numbers) if isinstance(v, torch.Tensor) else float(v) for key, v in figures.items()}

    # ---------------------------------------------------------------- a resume inside an epoch
    def saved(self, counts: Any) -> Optional[Dict[str, Any]]:
        # the epoch's train states so far over all ranks
        from basetrainer.metric import metric_states

        reduced = metric_states.reduce_states(counts)
        if not any(part["count"] for part in reduced.values()):
            return None
        return {name: {"count": part["count"], "states": {
            s: ([t.cpu() for t in v] if isinstance(v, list) else v.cpu()) for s, v in part["states"].items()}}
            for name, part in reduced.items()}

    def restore(self, counts: Any, saved: Dict[str, Any]) -> None:
        from basetrainer.metric import metric_states

        metric_states.load_states(counts, saved)

    # ---------------------------------------------------------------- events
    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        device = getattr(self.trainer, "device", None)
        if device is not None:
            for metric in self.metrics.values():
                metric.to(device)


class FunctionRecorder(LossesRecorder):
    """Writes the epoch's mean of ``fn(outputs, targets)`` as ``logs["<phase>/<indicator>"]``,
    sample-weighted and exact over every process (no torchmetrics needed).

    ``fn`` returns a tensor on the device: a scalar is the batch's mean (weighted by the batch's
    sample count); a tensor of values (``[N]`` per sample, or ``[N, H, W]`` per pixel) counts
    every entry as one sample. Resumable inside an epoch like LossesRecorder.

    Args:
        fn: ``fn(outputs, targets) -> tensor`` (outputs picked by ``output_key``).
        indicator: the figure's name.
        phases: the phases recorded, ``"train"`` and/or ``"test"``.
        target_key: the key of the targets in dict batches (see :class:`MetricRecorder`).
        output_key: the key of dict outputs (see :class:`MetricRecorder`).
        higher_is_better: tells ModelCheckpoint and EarlyStopping with no ``mode`` which way
            is better (None: the name decides).

    Example::

        FunctionRecorder(lambda out, y: (out - y).abs().mean(dim=1), indicator="L1")
    """

    def __init__(self, fn: Callable[[Any, Any], torch.Tensor], indicator: str, phases: Sequence[str] = PHASES,
                 target_key: Optional[str] = None, output_key: Optional[str] = None,
                 higher_is_better: Optional[bool] = None) -> None:
        if not callable(fn):
            raise TypeError(f"fn={fn!r} must be callable: fn(outputs, targets) -> tensor")
        if not isinstance(indicator, str) or not indicator.strip():
            raise ValueError(f"indicator={indicator!r} must be a non-empty name (the figure's logs key), "
                             f"e.g. indicator={getattr(fn, '__name__', 'score')!r}")
        super().__init__(indicator)
        self.fn = fn
        self.phases = check_phases(phases)
        self.target_key, self.output_key = target_key, output_key
        self._label = f"FunctionRecorder {indicator!r}"
        self.higher_is_better = higher_is_better

    def mode_of(self, key: str) -> Optional[str]:
        """``"max"``/``"min"`` for this recorder's figure when ``higher_is_better`` was given."""
        phase, _, name = key.rpartition("/")
        if self.higher_is_better is None or phase not in self.phases or name != self.indicator:
            return None
        return "max" if self.higher_is_better else "min"

    def update(self, counts: Any, inputs: Any, outputs: Any, losses: Any) -> None:
        value = self.fn(pick_output(outputs, self.output_key, self._label),
                        pick_targets(inputs, self.target_key))
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"FunctionRecorder {self.indicator!r}: fn returned a {type(value).__name__}; it must "
                            f"return a tensor (a batch mean, or one value per sample) on the device")
        value = value.detach()
        if value.dim() == 0:
            counts.add({self.indicator: value}, batch_size_of(inputs))
        else:
            counts.add({self.indicator: value.sum()}, value.numel(), per_sample=False)
