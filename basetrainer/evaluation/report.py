"""The evaluation report of a classifier, from its per-sample outputs and the labels.

:func:`write_report` writes into one folder (``work_dir/eval/`` by default in
:class:`~basetrainer.callbacks.eval_report.EvalReport`):

- ``report.json``: accuracy, balanced accuracy, top-k accuracy, macro and weighted averages,
  macro ROC AUC, and per class precision, recall, F1, support, ROC AUC, PR AUC and average
  precision; the confusion matrix (counts);
- ``report.md``: the same as tables; ``classification_report.txt``: scikit-learn's text;
- ``confusion_matrix.png`` (normalised by true class), ``roc.png`` and ``pr.png`` (one curve
  per class, one-vs-rest, the AUC in the legend).

Every figure is scikit-learn's (top-k: torchmetrics') on the same predictions: nothing is
hand-computed. Files are written atomically.
"""
import json
import logging
import math
import os
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from basetrainer.metric.eval_tools import classification_report as cr
from basetrainer.metric.eval_tools import deps, pr, roc
from basetrainer.runtime import atomic

logger = logging.getLogger(__name__)


def probabilities(outputs: Any, scores: str = "auto") -> np.ndarray:
    """``outputs`` ``[N, C]`` as class probabilities: softmax of logits (``scores="logits"``),
    as they are (``"probs"``), or ``"auto"``: as they are when every row is already a
    probability distribution, else a softmax."""
    x = deps.as_numpy(outputs, "outputs", np.float64)
    if x.ndim != 2:
        raise ValueError(f"outputs must be [samples, classes] scores; got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("outputs hold NaN or infinite scores")
    if scores not in ("auto", "logits", "probs"):
        raise ValueError(f"scores={scores!r} must be 'auto', 'logits' or 'probs'")
    is_probs = x.size > 0 and x.min() >= 0 and x.max() <= 1 and np.allclose(x.sum(1), 1.0, atol=1e-4)
    if scores == "probs" or (scores == "auto" and is_probs):
        return x
    shifted = x - x.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=1, keepdims=True)


def check_labels(labels: Any, num_classes: int, what: str = "labels") -> np.ndarray:
    """``labels`` as class indices (one-hot or soft rows: their argmax), each in ``[0, num_classes)``.

    Raises:
        ValueError: a label the model's ``num_classes`` outputs cannot hold, naming the sample.
    """
    y = deps.as_numpy(labels, what)
    if y.ndim == 2:
        y = y.argmax(axis=1)
    if y.ndim != 1:
        raise ValueError(f"{what} must be one class index per sample; got shape {y.shape}")
    if y.size and not np.all(np.equal(np.mod(y, 1), 0)):
        raise ValueError(f"{what} must be integer class indices; got {y.dtype} values such as {y[:3].tolist()}")
    y = y.astype(np.int64)
    bad = np.nonzero((y < 0) | (y >= num_classes))[0]
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"{what}: sample {i} has class {int(y[i])}, but the model outputs {num_classes} classes "
                         f"(0..{num_classes - 1}); {len(bad)} sample(s) are out of range. Build the model with "
                         f"num_classes >= {int(y.max()) + 1} (the classes of the data), or fix the labels")
    return y


def _topk(probs: np.ndarray, y: np.ndarray, ks: Sequence[int]) -> Dict[str, float]:
    import torch

    functional = deps.need("torchmetrics.functional.classification", "the report's top-k accuracy")
    c = probs.shape[1]
    out = {}
    for k in sorted({int(k) for k in ks if 1 <= int(k) <= c}):
        value = functional.multiclass_accuracy(torch.from_numpy(probs), torch.from_numpy(y), num_classes=c,
                                               top_k=k, average="micro")
        out[f"top{k}"] = float(value)
    return out


def _clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (np.floating, float)):
        return None if not math.isfinite(float(value)) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    return value


def compute_report(outputs: Any, labels: Any, class_names: Optional[Sequence[str]] = None,
                   topk: Sequence[int] = (1, 5), scores: str = "auto") -> Dict[str, Any]:
    """The report's figures (no file): see :func:`write_report`."""
    metrics = deps.sklearn_metrics()
    probs = probabilities(outputs, scores)
    n, c = probs.shape
    if n == 0:
        raise ValueError("the report needs at least one sample; got none")
    y = check_labels(labels, c)
    if len(y) != n:
        raise ValueError(f"outputs hold {n} samples but labels {len(y)}: give one label per output")
    names = [str(x) for x in class_names] if class_names is not None else [str(i) for i in range(c)]
    if len(names) != c:
        raise ValueError(f"class_names holds {len(names)} names, but the outputs have {c} classes")
    pred = probs.argmax(axis=1)
    table = cr.get_classification_report(y, pred, labels=list(range(c)), target_names=names, output_dict=True)
    per_class: Dict[str, Dict[str, Any]] = {}
    curves: Dict[str, List[Any]] = {"roc": [], "pr": []}
    for i, name in enumerate(names):
        row = dict(table[name])
        positive = (y == i).astype(int)
        if 0 < positive.sum() < n:   # a ROC/PR curve needs positives and negatives
            fpr, tpr, roc_auc, _, _ = roc.get_roc_curve(positive, probs[:, i], plot_roc=False)
            precision, recall, pr_auc = pr.get_classification_precision_recall(positive, probs[:, i])
            row.update(roc_auc=roc_auc, pr_auc=pr_auc,
                       average_precision=float(metrics.average_precision_score(positive, probs[:, i])))
            curves["roc"].append((fpr, tpr, roc_auc, name))
            curves["pr"].append((recall, precision, pr_auc, name))
        else:
            row.update(roc_auc=None, pr_auc=None, average_precision=None)
        per_class[name] = row
    present = sorted(set(y.tolist()))
    macro_auc = None
    if len(present) == c and c > 2:
        macro_auc = float(metrics.roc_auc_score(y, probs, multi_class="ovr", average="macro", labels=list(range(c))))
    elif c == 2 and len(present) == 2:
        macro_auc = float(metrics.roc_auc_score(y, probs[:, 1]))
    report = {
        "num_samples": int(n), "num_classes": int(c), "classes": names,
        "accuracy": float(metrics.accuracy_score(y, pred)),
        "balanced_accuracy": float(metrics.balanced_accuracy_score(y, pred)),
        "top_k": _topk(probs, y, topk),
        "macro_avg": table["macro_avg"], "weighted_avg": table["weighted_avg"],
        "roc_auc_macro": macro_auc,
        "per_class": per_class,
        "confusion_matrix": metrics.confusion_matrix(y, pred, labels=list(range(c))).tolist(),
    }
    return {"report": _clean(report), "curves": curves, "labels": y, "pred": pred}


def _markdown(report: Dict[str, Any], title: str) -> str:
    def f(v: Any) -> str:
        return "-" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))

    lines = [f"# {title}", "",
             f"{report['num_samples']} samples, {report['num_classes']} classes. "
             f"Accuracy **{f(report['accuracy'])}**, balanced accuracy **{f(report['balanced_accuracy'])}**"
             + "".join(f", {k} {f(v)}" for k, v in report["top_k"].items() if k != "top1")
             + (f", macro ROC AUC {f(report['roc_auc_macro'])}" if report["roc_auc_macro"] is not None else "") + ".",
             "", "| class | precision | recall | F1 | support | ROC AUC | PR AUC | AP |", "|---|---|---|---|---|---|---|---|"]
    for name, row in report["per_class"].items():
        lines.append(f"| {name} | {f(row['precision'])} | {f(row['recall'])} | {f(row['f1-score'])} | "
                     f"{int(row['support'])} | {f(row['roc_auc'])} | {f(row['pr_auc'])} | {f(row['average_precision'])} |")
    for key in ("macro_avg", "weighted_avg"):
        row = report[key]
        lines.append(f"| *{key.replace('_', ' ')}* | {f(row['precision'])} | {f(row['recall'])} | "
                     f"{f(row['f1-score'])} | {int(row['support'])} | | | |")
    lines += ["", "![confusion matrix](confusion_matrix.png)", "", "![ROC](roc.png)", "", "![PR](pr.png)", ""]
    return "\n".join(lines)


def write_report(outputs: Any, labels: Any, out_dir: str, class_names: Optional[Sequence[str]] = None,
                 topk: Sequence[int] = (1, 5), scores: str = "auto", title: str = "Evaluation report",
                 extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Write the evaluation report of ``outputs`` (``[N, C]`` logits or probabilities) against
    ``labels`` (``[N]`` class indices) into ``out_dir``.

    Args:
        outputs: per-sample class scores, in the order of ``labels``.
        labels: the true class of each sample (one-hot rows are read by their argmax).
        out_dir: the folder (created).
        class_names: a name per class (default: the indices).
        topk: the k of the top-k accuracies (those above the class count are left out).
        scores: ``"auto"``, ``"logits"`` (softmax taken) or ``"probs"``.
        title: the markdown page's title.
        extra: more entries for ``report.json`` (e.g. the epoch).

    Returns:
        The figures of ``report.json``, with ``files``: name -> path of every file written.

    Raises:
        ValueError: labels outside the outputs' classes (naming the sample), lengths that differ,
            no sample, class names that do not match the classes.
        ImportError: scikit-learn, matplotlib or torchmetrics missing (the pip command named).
    """
    computed = compute_report(outputs, labels, class_names, topk, scores)
    report, curves = computed["report"], computed["curves"]
    if extra:
        report.update(_clean(extra))
    os.makedirs(out_dir, exist_ok=True)
    files: Dict[str, str] = {}
    names = report["classes"]
    path = os.path.join(out_dir, "confusion_matrix.png")
    cr.get_confusion_matrix(computed["labels"], computed["pred"], target_names=names, filename=path,
                            title="Confusion matrix (normalised by true class)")
    files["confusion_matrix"] = path
    if curves["roc"]:
        path = os.path.join(out_dir, "roc.png")
        fpr, tpr, auc, line = zip(*curves["roc"])
        roc.plot_roc_curve(fpr, tpr, auc, line, filename=path, title="ROC, one class against the rest")
        files["roc"] = path
        path = os.path.join(out_dir, "pr.png")
        recall, precision, auc, line = zip(*curves["pr"])
        pr.plot_pr_curve(recall, precision, auc, line, filename=path, title="Precision-recall, one class against the rest")
        files["pr"] = path
    text = cr.get_classification_report(computed["labels"], computed["pred"], labels=list(range(len(names))),
                                        target_names=names)
    files["classification_report"] = atomic.write_atomically(text, os.path.join(out_dir, "classification_report.txt"))
    files["markdown"] = atomic.write_atomically(_markdown(report, title), os.path.join(out_dir, "report.md"))
    files["json"] = os.path.join(out_dir, "report.json")
    report["files"] = {k: os.path.basename(v) for k, v in files.items()}
    atomic.write_atomically(json.dumps(report, indent=2), files["json"])
    return {**report, "files": files}
