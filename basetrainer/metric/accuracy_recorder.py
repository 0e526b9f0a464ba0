"""Classification accuracy (top-1, optional top-k), per-class accuracy and confusion matrix."""
import logging
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from basetrainer.callbacks.callbacks import pick_output, targets_of
from basetrainer.callbacks.log_history import LogHistory
from basetrainer.callbacks.recorder import Recorder, sum_over_ranks
from basetrainer.runtime import atomic

_logger = logging.getLogger(__name__)


class ConfusionCounts:
    """A confusion matrix and top-k hit counts kept on the device (no host sync per update).

    An update only keeps the batch's targets and top-1 predictions; they are folded into the
    matrix (one ``bincount`` for many batches) when :attr:`matrix` is read, i.e. every
    ``log_freq`` steps, or after :data:`FOLD_EVERY` pending batches.
    """

    FOLD_EVERY = 256

    def __init__(self, topk: Sequence[int]) -> None:
        self.topk = tuple(topk)
        self._ks = [k for k in self.topk if k > 1]
        self._matrix: Optional[torch.Tensor] = None  # [num_classes * num_classes], rows = truth
        self._pending: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._classes = 0
        self.hits: Optional[torch.Tensor] = None     # [len(topk)] hits for k > 1

    @property
    def matrix(self) -> Optional[torch.Tensor]:
        """The flattened confusion matrix so far (None before the first update)."""
        self._fold()
        return self._matrix

    def reset(self) -> None:
        self._matrix, self._pending, self.hits = None, [], None

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        outputs = outputs.detach()
        if outputs.dim() != 2:
            raise ValueError(f"AccuracyRecorder expects outputs of shape [N, num_classes], got {tuple(outputs.shape)}")
        targets = targets.detach()
        if targets.dim() == 2:  # one-hot or soft labels
            targets = targets.argmax(dim=1)
        c = outputs.shape[1]
        if self._pending and c != self._classes:
            self._fold()
        self._classes = c
        self._pending.append((targets, outputs.argmax(dim=1)))
        if len(self._pending) >= self.FOLD_EVERY:
            self._fold()
        ks = self._ks
        if ks:
            targets = targets.to(device=outputs.device, dtype=torch.long)
            top = outputs.topk(min(max(ks), c), dim=1).indices
            hit = top == targets[:, None]
            counts = torch.stack([hit[:, :k].any(dim=1).sum() for k in ks])
            self.hits = counts if self.hits is None else self.hits.to(counts.device) + counts

    def load(self, matrix: torch.Tensor, hits: Optional[torch.Tensor]) -> None:
        """Start from saved counts (a ``[c, c]`` matrix; moved to the device of the next update)."""
        self.reset()
        self._classes = int(matrix.shape[0])
        self._matrix = matrix.reshape(-1).long()
        self.hits = None if hits is None or hits.numel() == 0 else hits.long()

    def _fold(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        c = self._classes
        preds = torch.cat([p for _, p in pending])
        targets = torch.cat([t.reshape(-1) for t, _ in pending]).to(device=preds.device, dtype=torch.long)
        counts = torch.bincount(targets * c + preds, minlength=c * c)
        if counts.numel() > c * c:
            raise ValueError(f"AccuracyRecorder: a target class index is >= {c}, the number of classes the "
                             f"model outputs; set num_classes to the number of classes in the data")
        if self._matrix is not None and self._matrix.numel() != c * c:
            raise ValueError(f"AccuracyRecorder: the model's outputs changed from "
                             f"{int(round(self._matrix.numel() ** 0.5))} to {c} classes within a phase")
        self._matrix = counts if self._matrix is None else self._matrix.to(counts.device) + counts

    def matrix_2d(self, num_classes: int) -> torch.Tensor:
        """The confusion matrix so far as ``[c, c]`` (zeros of ``num_classes`` before any update)."""
        matrix = self.matrix
        if matrix is None:
            return torch.zeros(num_classes, num_classes, dtype=torch.long)
        c = math.isqrt(matrix.numel())
        return matrix.reshape(c, c)


class AccuracyRecorder(Recorder):
    """Writes ``logs["train/<indicator>"]`` and ``logs["test/<indicator>"]``: the fraction of
    samples whose top-1 prediction is right, over the whole epoch and every process; with
    ``topk=(1, 5)`` also ``"<phase>/<indicator>_top5"``. At the end of each test phase it keeps
    the per-class accuracy and the confusion matrix as ``self.per_class`` and
    ``self.confusion_matrix``; the main process logs one line (the figure and the lowest
    per-class accuracies) and writes the whole table to ``<log_dir>/confusion_matrix.txt`` and,
    when a LogHistory writes TensorBoard, as the text ``test/confusion_matrix``.

    Figures are computed from a confusion matrix kept on the device; they are read every
    ``log_freq`` steps (running train figure) and at the end of each phase.

    Args:
        target_names: class names (their count fixes the number of classes when given).
        indicator: the figure's name (default ``"Accuracy"``).
        topk: which top-k accuracies to report; 1 is always reported.
        logger: where the summary line goes (default: this module's logger).
        log_dir: the folder of ``confusion_matrix.txt``; default the trainer's LogHistory's
            ``log_dir`` (none: no file).
        output_key: the key of the class scores in dict outputs; without it, a dict's
            ``"logits"``, else ``"out"``, else its only entry (several others: a ValueError asking
            for ``output_key``); a tuple's first element (the rule of every recorder:
            :func:`~basetrainer.callbacks.callbacks.pick_output`).
    """

    state_name = "AccuracyRecorder"

    def __init__(self, target_names: Optional[Sequence[str]] = None, indicator: str = "Accuracy",
                 topk: Sequence[int] = (1,), logger: Optional[logging.Logger] = None,
                 log_dir: Optional[str] = None, output_key: Optional[str] = None) -> None:
        if any((not isinstance(k, int)) or k < 1 for k in topk):
            raise ValueError(f"topk={tuple(topk)!r}: each k must be a positive integer")
        self.topk = tuple(sorted(set(topk) | {1}))
        super().__init__(indicator)
        self.target_names = list(target_names) if target_names is not None else None
        self.logger = logger or _logger
        self.confusion_matrix: Optional[torch.Tensor] = None
        self.per_class: Dict[str, float] = {}
        self.log_dir = log_dir
        self.output_key, self._label = output_key, f"AccuracyRecorder {indicator!r}"
        self._history: Optional[LogHistory] = None     # the LogHistory whose folder and TensorBoard writer are used

    # ---------------------------------------------------------------- what it counts
    def new_counts(self, phase: str) -> ConfusionCounts:
        return ConfusionCounts(self.topk)

    def update(self, counts: ConfusionCounts, inputs: Any, outputs: Any, losses: Any) -> None:
        if not isinstance(outputs, torch.Tensor) or self.output_key is not None:   # a tensor: no call (the budget)
            outputs = pick_output(outputs, self.output_key, self._label)
        counts.update(outputs, targets_of(inputs))

    def compute(self, counts: ConfusionCounts, reduce: bool) -> Dict[str, Any]:
        """Accuracy figures of ``counts`` (summed over ranks when ``reduce``), with the
        confusion matrix (``"matrix"``), the top-k hits (``"hits"``) and the sample count
        (``"total"``); empty before any class is known."""
        matrix, hits = counts.matrix, counts.hits
        named = self.target_names is not None
        c = len(self.target_names) if named else 0 if matrix is None else math.isqrt(matrix.numel())
        if matrix is not None and matrix.numel() != c * c:
            raise ValueError(f"the model outputs {math.isqrt(matrix.numel())} classes but target_names has {c}: "
                             f"set num_classes to the number of class folders")
        ks = [k for k in self.topk if k > 1]
        if reduce:
            if named:   # every rank knows the shapes: they need not be gathered
                matrix = matrix if matrix is not None else torch.zeros(c * c, dtype=torch.long)
                hits = hits if hits is not None else torch.zeros(len(ks), dtype=torch.long)
            summed, _ = sum_over_ranks({"matrix": matrix, "hits": hits}, agreed=named)
            matrix, hits = summed.get("matrix"), summed.get("hits")
            if not named:
                c = 0 if matrix is None else math.isqrt(matrix.numel())
        if c == 0:
            return {}
        matrix = matrix if matrix is not None else torch.zeros(c * c, dtype=torch.long)
        hits = hits if hits is not None else torch.zeros(len(ks), dtype=torch.long, device=matrix.device)
        packed = torch.cat([matrix.reshape(-1), hits.to(matrix.device)]).cpu()
        matrix = packed[: c * c].reshape(c, c)
        total = int(matrix.sum())
        figures: Dict[str, Any] = {"matrix": matrix, "hits": packed[c * c:], "total": total}
        figures[self.indicator] = float(matrix.diag().sum()) / total if total else float("nan")
        for k, h in zip(ks, packed[c * c:].tolist()):
            figures[f"{self.indicator}_top{k}"] = h / total if total else float("nan")
        return figures

    def figures(self) -> List[str]:
        return [self.indicator] + [f"{self.indicator}_top{k}" for k in self.topk if k > 1]

    def publish(self, phase: str, figures: Dict[str, Any], logs: Optional[dict]) -> None:
        if logs is None or not figures.get("total"):   # no sample counted (e.g. resumed at the test phase)
            return
        for key, value in figures.items():
            if key.startswith(self.indicator):
                logs[f"{phase}/{key}"] = value

    def saved(self, counts: ConfusionCounts) -> Optional[Dict[str, Any]]:
        figures = self.compute(counts, reduce=True)
        return {"matrix": figures["matrix"], "hits": figures["hits"]} if figures else None

    def restore(self, counts: ConfusionCounts, saved: Dict[str, Any]) -> None:
        counts.load(saved["matrix"], saved.get("hits"))

    # ---------------------------------------------------------------- events
    def run_folders(self) -> List[str]:
        return [self.log_dir] if self.log_dir else []

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self._history = None
        if self.log_dir is None:   # the table goes beside the history's files
            self._history = next((c for c in getattr(self.trainer, "callbacks", None) or []
                                  if isinstance(c, LogHistory) and c.log_dir), None)

    def on_test_end(self, logs: Optional[dict] = None) -> None:
        if not self.records("test"):
            return
        figures = self.compute(self.test, reduce=True)
        if not figures:
            return
        self.publish("test", figures, logs)
        matrix = figures["matrix"]
        self.confusion_matrix = matrix
        names = self.class_names(matrix.shape[0])
        support = matrix.sum(dim=1)
        self.per_class = {n: (float(matrix[i, i]) / int(support[i]) if int(support[i]) else float("nan"))
                          for i, n in enumerate(names)}
        if self.is_main_process:
            self._write_report(figures)

    def _write_report(self, figures: Dict[str, Any]) -> None:
        """One line to the log; the whole table to a file and to TensorBoard."""
        history = self._history if self._history is not None and self._history.is_main_process else None
        folder = self.log_dir or (history.log_dir if history is not None else None)
        lowest = sorted((v, n) for n, v in self.per_class.items() if v == v)[:3]
        path = os.path.join(folder, "confusion_matrix.txt") if folder else None
        self.logger.info("test %s %.4f over %d samples; lowest per class: %s%s", self.indicator,
                         figures[self.indicator], figures["total"], ", ".join(f"{n} {v:.4f}" for v, n in lowest),
                         f" (table: {path})" if path else "")
        report = self.report()
        if path:
            atomic.write_atomically(report + "\n", path)
        writer = history.writer if history is not None else None
        if writer is not None and self.trainer is not None:
            writer.add_text("test/confusion_matrix", "```\n" + report + "\n```", self.trainer.epoch)

    def class_names(self, num_classes: int) -> List[str]:
        names = list(self.target_names or [])
        return [str(n) for n in names[:num_classes]] + [str(i) for i in range(len(names), num_classes)]

    def report(self) -> str:
        """Per-class accuracy and the confusion matrix of the last test phase, as text."""
        if self.confusion_matrix is None:
            return "no test figures yet"
        matrix = self.confusion_matrix
        names = self.class_names(matrix.shape[0])
        width = max(6, max(len(n) for n in names) + 1)
        lines = ["per-class accuracy (test):"]
        lines += [f"  {n:<{width}} {acc:.4f}  ({int(matrix[i].sum())} samples)"
                  for i, (n, acc) in enumerate(self.per_class.items())]
        lines.append("confusion matrix (rows: truth, columns: prediction):")
        lines.append(" " * (width + 2) + " ".join(f"{n[:width]:>{width}}" for n in names))
        for i, n in enumerate(names):
            lines.append(f"  {n:<{width}}" + " ".join(f"{int(v):>{width}}" for v in matrix[i].tolist()))
        return "\n".join(lines)
