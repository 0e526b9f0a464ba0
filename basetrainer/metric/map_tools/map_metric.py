"""Detection mean average precision at one IoU threshold, on torchmetrics'
``MeanAveragePrecision`` (COCO's evaluation: pycocotools, or faster-coco-eval), exact over ranks.

Each rank may hold a share of the images. The images' records are gathered from every rank
and put in one order (by file name) before COCO's evaluation runs in each process, so the
figures are those of one process over all the images, whatever the split (COCO's accumulation
orders equal scores by image order: the ranks' images concatenated in rank order gave another
mAP, 0.793 against 0.856, in tests/test_eval_map.py's case).

``gt_info`` / ``dt_info`` map a file name to ``{"boxes": [[x1, y1, x2, y2], ...], "labels":
[...]}`` (detections also ``"scores"``); a label is a class index or a name of ``class_name``.
:meth:`MapMetric.build_data_info` fills them.
"""
import importlib.util
import logging
import math
import numbers
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from basetrainer.metric.eval_tools import deps
from basetrainer.runtime import comm
from basetrainer.runtime.errors import MissingExtraError

logger = logging.getLogger(__name__)

BACKENDS = {"pycocotools": "pycocotools", "faster_coco_eval": "faster_coco_eval"}
# COCO's 101 recall points, built as COCOeval builds them (float64). torchmetrics' default is a
# float32 linspace, where 0.8 is 0.8000000119: a precision reached at recall 0.8 was left out
# of that point (AP 0.5417 for COCOeval's 0.5474 in tests/test_eval_map.py's case)
RECALL_POINTS = np.linspace(0.0, 1.0, 101).tolist()


def _backend(name: Optional[str]) -> str:
    if name is not None:
        if name not in BACKENDS:
            raise ValueError(f"backend={name!r}: choose from {sorted(BACKENDS)}")
        return name
    for backend, module in BACKENDS.items():
        if importlib.util.find_spec(module) is not None:
            return backend
    raise MissingExtraError(f"MapMetric needs COCO's evaluation (pycocotools or faster-coco-eval), and neither is "
                            f"installed: {deps.INSTALL}")


class MapMetric:
    """mAP and per-class AP at IoU ``min_iou``: pycocotools' COCOeval (101-point interpolation,
    all areas, the ``max_detections`` best-scored detections of each class in each image), the
    mAP being the mean AP over the classes that have ground truth.

    Args:
        min_iou: the IoU a detection needs with a ground-truth box of its class to count.
        box_format: ``"xyxy"`` (default), ``"xywh"`` or ``"cxcywh"``.
        backend: ``"pycocotools"`` or ``"faster_coco_eval"`` (default: the first installed).
        max_detections: detections of a class kept per image, the best-scored (COCO's
            ``maxDets``; an integer >= 1).

    Example::

        metric = MapMetric(min_iou=0.5)
        aps, map50 = metric.evaluate(gt_info, dt_info, class_name=["cat", "dog"])
    """

    def __init__(self, min_iou: float = 0.5, box_format: str = "xyxy", backend: Optional[str] = None,
                 max_detections: int = 100) -> None:
        if not 0.0 < float(min_iou) <= 1.0:
            raise ValueError(f"min_iou={min_iou!r} must be in (0, 1]")
        if box_format not in ("xyxy", "xywh", "cxcywh"):
            raise ValueError(f"box_format={box_format!r}: choose from xyxy, xywh, cxcywh")
        self.min_iou = float(min_iou)
        self.box_format = box_format
        if isinstance(max_detections, bool) or not isinstance(max_detections, numbers.Integral) or max_detections < 1:
            raise ValueError(f"max_detections={max_detections!r} must be an integer >= 1 (the detections of a "
                             f"class kept per image; COCO's default is 100)")
        self.backend = _backend(backend)
        self.max_detections = int(max_detections)
        self.records: Dict[str, tuple] = {}

    def reset(self) -> None:
        self.records = {}

    def update(self, gt_info: Dict[str, Any], dt_info: Dict[str, Any], class_name: Sequence[str]) -> None:
        """Add images: every file of ``gt_info`` and ``dt_info`` (a file in one only has no
        detections / no ground truth)."""
        names = list(class_name)
        for key in sorted(set(gt_info) | set(dt_info)):
            if key in self.records:
                raise ValueError(f"image {key!r} was given twice")
            gt = gt_info.get(key) or {}
            dt = dt_info.get(key) or {}
            gt_boxes, gt_labels, _ = _arrays(gt, names, key, "gt_info", scored=False)
            dt_boxes, dt_labels, dt_scores = _arrays(dt, names, key, "dt_info", scored=True)
            self.records[str(key)] = (gt_boxes, gt_labels, dt_boxes, dt_labels, dt_scores)

    def compute(self, class_name: Sequence[str], sync: bool = True) -> Tuple[Dict[str, Optional[float]], float]:
        """``aps, map``: AP per class name (None for a class without ground truth) and the mean
        over the classes that have some. With ``sync`` in a multi-process run, the images of
        every rank (each rank its own share; a collective)."""
        import torch

        need = deps.need("torchmetrics.detection", "MapMetric")
        records = self.records
        if sync and comm.is_dist() and comm.get_world_size() > 1:
            records = {}
            for rank, part in enumerate(comm.all_gather_object(self.records)):
                for key, value in part.items():
                    if key in records:
                        raise ValueError(f"image {key!r} is held by more than one rank: give each rank its own share")
                    records[key] = value
        # COCOeval keeps maxDets[-1] detections per image and class; torchmetrics wants three
        # limits and sorts them ([1, 10, N] put 10 last for N < 10)
        limits = [1, min(10, self.max_detections), self.max_detections]
        metric = need.MeanAveragePrecision(box_format=self.box_format, iou_type="bbox", iou_thresholds=[self.min_iou],
                                           rec_thresholds=RECALL_POINTS, max_detection_thresholds=limits,
                                           extended_summary=True, backend=self.backend, sync_on_compute=False)
        preds, targets = [], []
        for key in sorted(records):
            gt_boxes, gt_labels, dt_boxes, dt_labels, dt_scores = records[key]
            targets.append({"boxes": torch.from_numpy(gt_boxes), "labels": torch.from_numpy(gt_labels)})
            preds.append({"boxes": torch.from_numpy(dt_boxes), "labels": torch.from_numpy(dt_labels),
                          "scores": torch.from_numpy(dt_scores)})
        if not preds:
            raise ValueError("MapMetric: no image was given")
        metric.update(preds, targets)
        result = metric.compute()
        # COCOeval's precision table [IoU, recall point, class, area, maxDets] read at area "all"
        # and maxDets[-1], as its summary reads it (stats[0] is fixed at maxDets 100); -1: a class
        # without ground truth. Its classes are the labels seen, in increasing order
        table = result["precision"][0, :, :, 0, -1].double().numpy()
        names = list(class_name)
        aps: Dict[str, Optional[float]] = {n: None for n in names}
        for k, c in enumerate(result["classes"].reshape(-1).tolist()):
            if 0 <= c < len(names) and (table[:, k] > -1).all():
                aps[names[c]] = float(table[:, k].mean())
        held = table[table > -1]
        return aps, (float(held.mean()) if held.size else float("nan"))

    def evaluate(self, gt_info: Dict[str, Any], dt_info: Dict[str, Any], class_name: Sequence[str], plot: bool = False,
                 filename: Optional[str] = None, sync: bool = True) -> Tuple[Dict[str, Optional[float]], float]:
        """``aps, map`` of these images (the original's call); ``plot``/``filename``: a bar chart
        of the APs (written to ``filename`` as PNG)."""
        self.reset()
        self.update(gt_info, dt_info, class_name)
        aps, value = self.compute(class_name, sync=sync)
        logger.info("mAP@%.2f = %.4f; AP per class: %s", self.min_iou, value, aps)
        if plot or filename:
            fig = deps.figure(max(4.0, 0.6 * len(aps) + 2), 4.0)
            ax = fig.add_subplot(1, 1, 1)
            ax.bar(range(len(aps)), [v or 0.0 for v in aps.values()])
            ax.set_xticks(range(len(aps)))
            ax.set_xticklabels(list(aps), rotation=45, ha="right")
            ax.set_ylim(0, 1)
            ax.set_ylabel(f"AP@{self.min_iou:g}")
            ax.set_title(f"mAP@{self.min_iou:g} = {value:.4f}")
            deps.save(fig, filename)
        return aps, value

    @staticmethod
    def build_data_info(data_info: Dict[str, Any], file_name: str, boxes: List[Any], label: List[Any],
                        score: Optional[List[float]] = None, class_name: Optional[Sequence[str]] = None) -> Dict[str, Any]:
        """Add one image to ``data_info`` (labels given as names are turned into indices of
        ``class_name``); return ``data_info``."""
        labels = list(label)
        if class_name is not None and labels and isinstance(labels[0], str):
            labels = [_index(x, list(class_name), file_name, "label") for x in labels]
        entry = {"boxes": [list(b) for b in boxes], "labels": labels}
        if score is not None and len(score):
            entry["scores"] = list(score)
        data_info[file_name] = entry
        return data_info


def _index(label: Any, names: List[str], key: str, what: str) -> int:
    if isinstance(label, str):
        if label not in names:
            raise ValueError(f"{what} of {key!r}: class {label!r} is not in class_name {names}")
        return names.index(label)
    try:   # an int, a numpy or 0-d tensor integer, or a float that is one (1.0); not 1.7, nan, True
        number = float(label)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(label, bool) or not math.isfinite(number) or number != int(number):
        raise ValueError(f"{what} of {key!r}: {label!r} is not a class index (an integer in 0..{len(names) - 1}) "
                         f"nor a name of class_name {names}")
    value = int(number)
    if not 0 <= value < len(names):
        raise ValueError(f"{what} of {key!r}: class index {value} is outside class_name's {len(names)} classes")
    return value


def _arrays(entry: Dict[str, Any], names: List[str], key: str, what: str, scored: bool) -> tuple:
    boxes = np.asarray(entry.get("boxes", []), dtype=np.float32).reshape(-1, 4) if len(entry.get("boxes", [])) else \
        np.zeros((0, 4), np.float32)
    labels = np.asarray([_index(x, names, key, what) for x in entry.get("labels", [])], dtype=np.int64)
    if len(labels) != len(boxes):
        raise ValueError(f"{what}[{key!r}]: {len(boxes)} boxes but {len(labels)} labels")
    scores = np.asarray(entry.get("scores", []), dtype=np.float32)
    if scored and len(scores) != len(boxes):
        raise ValueError(f"{what}[{key!r}]: {len(boxes)} detections but {len(scores)} scores: give a score per box")
    # COCO's IoU and ranking take NaN and infinity without a word (a NaN box matched its ground truth)
    for name, values in (("box", boxes), ("score", scores.reshape(-1, 1))):
        bad = np.flatnonzero(~np.isfinite(values).all(axis=1))
        if bad.size:
            i = int(bad[0])
            shown = values[i].tolist() if name == "box" else float(values[i, 0])
            raise ValueError(f"{what}[{key!r}]: {name} {i} is {shown}: boxes and scores must be finite numbers")
    return boxes, labels, scores
