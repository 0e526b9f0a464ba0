"""EvalReport: the evaluation report of a classifier at the end of training (or every test
epoch), exact over the ranks, in ``work_dir/eval/``, TensorBoard and the trackers."""
import logging
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from basetrainer.callbacks.callbacks import Callback, pick_output, targets_of
from basetrainer.runtime import comm

_logger = logging.getLogger(__name__)


class EvalReport(Callback):
    """Collects the test phase's outputs and labels, gathers them from every rank in dataset
    order (:func:`~basetrainer.evaluation.ordered.gather_ordered`: no padding, no duplicate, so
    the figures are those of one process), and writes the report of
    :func:`~basetrainer.evaluation.report.write_report` (classification report, normalised
    confusion matrix, per-class ROC and PR curves with AUC, top-k accuracy, JSON and markdown),
    with a Grad-CAM grid of test images (``cam_images``).

    When: the last epoch's test phase (also when training stops early), or every test phase
    (``every_epoch``: into ``epoch_<n>/`` folders). Only the main process writes. The PNGs go
    to TensorBoard as images (``eval/<name>``, x = the epoch; LogHistory's writer, or one of its
    own in LogHistory's log_dir / ``work_dir/log``) and every file to the trackers (MLflow,
    W&B) as artifacts under ``eval/``. ``last_report`` holds the last report's figures.

    Args:
        out_dir: the report's folder (default: ``<work_dir>/eval``).
        class_names: a name per class (default: the config's ``classes``, else the test data
            set's ``classes``, else the indices).
        every_epoch: a report after every test phase, not only the last.
        topk: the k of the top-k accuracies.
        scores: ``"auto"``, ``"logits"`` or ``"probs"`` (see :func:`~basetrainer.evaluation.report.probabilities`).
        outputs_fn: maps a batch's model outputs to ``[batch, classes]`` scores (default: the
            recorders' rule, :func:`~basetrainer.callbacks.callbacks.pick_output`: a tuple's
            first entry; a dict's ``"logits"``, ``"out"`` or only entry).
        cam_images: test images in the Grad-CAM grid (0: none); ``cam_layer``/``cam_type``:
            see :class:`~basetrainer.utils.torchcam_utils.TorchCAM`.
        tensorboard, trackers: log the PNGs to TensorBoard / the files to the trackers.

    Raises:
        ValueError: at ``on_train_begin``, no test loader, or a test loader that would count
            samples twice or not at all over the processes (see
            :func:`~basetrainer.dataloader.loader.check_test_shards`);
            when reporting, labels the model's class count cannot hold (on every rank).
        ImportError: scikit-learn, matplotlib, torchmetrics (or torchcam, with ``cam_images``)
            missing: ``pip install "basetrainer[eval]"``.

    Example::

        callbacks = [AccuracyRecorder(), LogHistory(log_dir, log_freq), EvalReport(cam_images=8)]
    """

    def __init__(self, out_dir: Optional[str] = None, class_names: Optional[Sequence[str]] = None,
                 every_epoch: bool = False, topk: Sequence[int] = (1, 5), scores: str = "auto",
                 outputs_fn: Optional[Callable[[Any], torch.Tensor]] = None, cam_images: int = 0,
                 cam_layer: Any = None, cam_type: str = "GradCAM", tensorboard: bool = True,
                 trackers: bool = True) -> None:
        super().__init__()
        from basetrainer.evaluation import report   # checks the optional packages early
        from basetrainer.metric.eval_tools import deps

        deps.need("sklearn.metrics", "EvalReport")
        deps.need("matplotlib", "EvalReport")
        deps.need("torchmetrics", "EvalReport")
        if scores not in ("auto", "logits", "probs"):
            raise ValueError(f"scores={scores!r} must be 'auto', 'logits' or 'probs'")
        if isinstance(cam_images, bool) or not isinstance(cam_images, int) or cam_images < 0:
            raise ValueError(f"cam_images={cam_images!r} must be an integer >= 0 (0 = no Grad-CAM grid)")
        if cam_images:
            from basetrainer.utils import torchcam_utils

            torchcam_utils._torchcam()
            if cam_type not in torchcam_utils.CAM_TYPES:
                raise ValueError(f"cam_type={cam_type!r}: choose from {list(torchcam_utils.CAM_TYPES)}")
        self._report = report
        self.out_dir = out_dir
        self.class_names = list(class_names) if class_names is not None else None
        self.every_epoch = bool(every_epoch)
        self.topk = tuple(topk)
        self.scores = scores
        self.outputs_fn = outputs_fn
        self.cam_images, self.cam_layer, self.cam_type = cam_images, cam_layer, cam_type
        self.tensorboard, self.trackers = tensorboard, trackers
        self.last_report: Optional[Dict[str, Any]] = None
        self._scores: List[torch.Tensor] = []
        self._labels: List[torch.Tensor] = []
        self._cam_inputs: List[torch.Tensor] = []
        self._cam_labels: List[torch.Tensor] = []
        self._tested: Optional[int] = None      # the epoch of the outputs held
        self._reported: Optional[int] = None
        self._writer: Any = None

    # ------------------------------------------------------------------ events
    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        loader = getattr(self.trainer, "test_loader", None)
        if loader is None:
            raise ValueError("EvalReport evaluates the test phase, and the trainer has no test loader: return "
                             "one from build_test_loader (e.g. set test_data), or remove EvalReport")
        from basetrainer.dataloader.loader import check_test_shards

        check_test_shards(loader, "EvalReport: the test loader")   # evaluate() checks its loader itself
        self._tested, self._reported = None, None

    def on_test_begin(self, logs: Optional[dict] = None) -> None:
        self._scores, self._labels, self._cam_inputs, self._cam_labels = [], [], [], []

    def on_test_summary(self, inputs: Any, outputs: Any, losses: Any, epoch: int, batch: int,
                        logs: Optional[dict] = None) -> None:
        scores = self.outputs_fn(outputs) if self.outputs_fn is not None else \
            pick_output(outputs, None, "EvalReport", "give EvalReport(outputs_fn=lambda outputs: outputs[<key>])")
        if not isinstance(scores, torch.Tensor) or scores.dim() != 2:
            raise ValueError(f"EvalReport needs [batch, classes] scores; the model's outputs are "
                             f"{type(scores).__name__}{tuple(scores.shape) if isinstance(scores, torch.Tensor) else ''}: "
                             f"give outputs_fn= to pick them")
        labels = targets_of(inputs)
        self._scores.append(scores.detach())
        self._labels.append(labels.detach())
        self._tested = epoch
        need = self.cam_images - sum(len(x) for x in self._cam_inputs)
        if need > 0 and self.is_main_process and isinstance(inputs, (list, tuple)) and \
                isinstance(inputs[0], torch.Tensor) and inputs[0].dim() == 4:
            self._cam_inputs.append(inputs[0][:need].detach())   # the first batches only
            self._cam_labels.append(labels[:need].detach())

    def on_test_end(self, logs: Optional[dict] = None) -> None:
        trainer = self.trainer
        epoch = int(getattr(trainer, "epoch", 0))
        last = epoch + 1 >= int(getattr(trainer, "num_epochs", epoch + 1))
        if self.every_epoch or last or getattr(trainer, "evaluating", False):   # evaluate(): a report
            self.report(epoch)

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        trainer = self.trainer
        stopped = bool(getattr(trainer, "stop_training", False)) and getattr(trainer, "phase", "") == "end"
        try:
            if stopped and self._tested is not None and self._reported != self._tested:   # an early stop
                self.report(self._tested)
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    # ------------------------------------------------------------------ the report
    def report(self, epoch: int) -> Optional[Dict[str, Any]]:
        """Gather the held outputs (every rank must call it) and write the report (main process);
        return its figures there (None elsewhere)."""
        from basetrainer.evaluation.ordered import gather_ordered

        mine = None
        if self._scores:
            mine = {"scores": torch.cat(self._scores).float(), "labels": _as_index(torch.cat(self._labels))}
        problems = comm.all_gather_object(self._check(mine))
        bad = [p for p in problems if p]
        if bad:
            raise ValueError(bad[0])
        gathered = gather_ordered(mine, dst=0)
        self._reported = epoch
        if not self.is_main_process or gathered is None:
            return None
        out_dir = self._folder(epoch)
        names = self._names(gathered["scores"].shape[1])
        result = self._report.write_report(gathered["scores"], gathered["labels"], out_dir, class_names=names,
                                           topk=self.topk, scores=self.scores,
                                           title=self._title(epoch), extra={"epoch": epoch})
        if self._cam_inputs:
            result["files"]["gradcam"] = self._cam(out_dir, names)
        self.last_report = result
        _logger.info("EvalReport epoch %d: accuracy %.4f, balanced accuracy %.4f, %d samples -> %s", epoch + 1,
                     result["accuracy"], result["balanced_accuracy"], result["num_samples"], out_dir)
        if not getattr(self.trainer, "evaluating", False):   # evaluate() writes no file of the run (its event files)
            self._publish(result["files"], epoch, out_dir)
        return result

    def _check(self, mine: Optional[Dict[str, torch.Tensor]]) -> Optional[str]:
        """This rank's labels against the outputs' class count: the error message, or None."""
        if mine is None:
            return None
        labels, classes = mine["labels"], mine["scores"].shape[1]
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= classes):
            wrong = int(labels.max()) if int(labels.max()) >= classes else int(labels.min())
            return (f"EvalReport: the test labels hold class {wrong}, but the model outputs {classes} classes "
                    f"(0..{classes - 1}): set num_classes to the number of classes in the data "
                    f"(>= {max(int(labels.max()) + 1, classes)}), or fix the labels")
        return None

    def _folder(self, epoch: int) -> str:
        base = self.out_dir
        if not base:
            cfg = getattr(self.trainer, "cfg", None)
            work_dir = cfg.get("work_dir") if hasattr(cfg, "get") else None
            base = os.path.join(work_dir or ".", "eval")
        if getattr(self.trainer, "evaluating", False):   # evaluate(): a folder of its own, not the run's report
            return os.path.join(base, "evaluate")
        return os.path.join(base, f"epoch_{epoch + 1:03d}") if self.every_epoch else base

    def _title(self, epoch: int) -> str:
        if getattr(self.trainer, "evaluating", False):
            tested = getattr(self.trainer, "evaluating_checkpoint", None)
            return "Evaluation report, evaluate() of " + (os.path.basename(tested) if tested else "the trainer's weights")
        return f"Evaluation report, epoch {epoch + 1}"

    def _names(self, classes: int) -> Optional[List[str]]:
        for names in (self.class_names, _get(getattr(self.trainer, "cfg", None), "classes"),
                      getattr(getattr(getattr(self.trainer, "test_loader", None), "dataset", None), "classes", None)):
            if names is not None and len(names) == classes:
                return [str(n) for n in names]
        return None

    def _cam(self, out_dir: str, names: Optional[List[str]]) -> Optional[str]:
        from basetrainer.utils import torchcam_utils

        trainer = self.trainer
        if getattr(trainer, "strategy", "ddp") == "fsdp":
            _logger.warning("EvalReport: no Grad-CAM grid under strategy fsdp (the model is sharded)")
            return None
        model = getattr(trainer, "unwrapped_model", None) or self.model
        inputs = torch.cat(self._cam_inputs)
        labels = torch.cat(self._cam_labels)
        try:
            return torchcam_utils.cam_grid(model, inputs, _as_index(labels).tolist(), os.path.join(out_dir, "gradcam.png"),
                                           class_names=names, target_layer=self.cam_layer, cam_type=self.cam_type)
        except (RuntimeError, ValueError, TypeError) as e:   # a model torchcam cannot map: the report stands
            _logger.warning("EvalReport: no Grad-CAM grid (%s: %s); set cam_layer to a layer with a spatial output, "
                            "or cam_images=0", type(e).__name__, e)
            return None

    def _publish(self, files: Dict[str, Optional[str]], epoch: int, out_dir: str) -> None:
        from basetrainer.callbacks.log_history import LogHistory
        from basetrainer.callbacks.trackers import Tracker

        history = next((c for c in getattr(self.trainer, "callbacks", None) or [] if isinstance(c, LogHistory)), None)
        if self.tensorboard:
            writer = self._tensorboard(history)
            if writer is not None:
                import numpy as np
                from PIL import Image

                for name, path in files.items():
                    if path and path.endswith(".png"):
                        with Image.open(path) as im:
                            writer.add_image(f"eval/{name}", np.asarray(im.convert("RGB")), epoch, dataformats="HWC")
                writer.flush()
        if self.trackers:
            sinks = list(history.sinks) if history is not None else []
            sinks += [c for c in getattr(self.trainer, "callbacks", None) or [] if isinstance(c, Tracker) and c not in sinks]
            folder = "eval" if not self.every_epoch else f"eval/{os.path.basename(out_dir)}"
            for tracker in sinks:
                tracker.log_artifacts([p for p in files.values() if p], folder)

    def _tensorboard(self, history: Any) -> Any:
        if history is not None and history.writer is not None:
            return history.writer
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            cfg = getattr(self.trainer, "cfg", None)
            work_dir = _get(cfg, "work_dir")
            # no LogHistory: the run's log folder, else beside the report (never the current folder's log/)
            log_dir = (history.log_dir if history is not None else None) or (
                os.path.join(work_dir, "log") if work_dir else os.path.join(self.out_dir or "eval", "log"))
            self._writer = SummaryWriter(log_dir=log_dir)
        return self._writer


def _get(cfg: Any, key: str) -> Any:
    return cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)


def _as_index(labels: torch.Tensor) -> torch.Tensor:
    """Class indices (one-hot or soft rows: their argmax)."""
    if labels.dim() == 2:
        labels = labels.argmax(dim=1)
    return labels.reshape(-1).long()
