"""Classification report and confusion matrix (scikit-learn), as basetrainer 1.0.4 named them."""
import logging
from typing import Any, Dict, Optional, Sequence, Union

from basetrainer.metric.eval_tools import deps

logger = logging.getLogger(__name__)


def _labels(true_labels: Any, pred_labels: Any, labels: Optional[Sequence[int]],
            target_names: Optional[Sequence[str]]) -> Any:
    import numpy as np

    if labels is not None:
        return list(labels)
    if target_names is not None:
        return list(range(len(target_names)))
    return sorted(set(np.asarray(true_labels).tolist()) | set(np.asarray(pred_labels).tolist()))


def get_classification_report(true_labels: Any, pred_labels: Any, labels: Optional[Sequence[int]] = None,
                              target_names: Optional[Sequence[str]] = None,
                              output_dict: bool = False) -> Union[str, Dict[str, Any]]:
    """Precision, recall, F1 and support per class (``sklearn.metrics.classification_report``).

    Args:
        true_labels: the true class index per sample.
        pred_labels: the predicted class index per sample.
        labels: the class indices to report (default: ``range(len(target_names))``, else those
            present).
        target_names: a name per class of ``labels``.
        output_dict: return a dict (per class name, ``accuracy``, ``macro_avg``,
            ``weighted_avg``, spaces in scikit-learn's keys made underscores) instead of the text.

    A class that has no predicted sample has precision 0 (no warning).
    """
    metrics = deps.sklearn_metrics()
    deps.same_length(true_labels=true_labels, pred_labels=pred_labels)
    labels = _labels(true_labels, pred_labels, labels, target_names)
    names = [str(n) for n in target_names] if target_names is not None else None
    if names is not None and len(names) != len(labels):
        raise ValueError(f"target_names holds {len(names)} names for {len(labels)} classes {labels}")
    text = metrics.classification_report(true_labels, pred_labels, labels=labels, target_names=names, digits=4,
                                         zero_division=0)
    logger.info("classification report:\n%s", text)
    if not output_dict:
        return text
    report = metrics.classification_report(true_labels, pred_labels, labels=labels, target_names=names,
                                           output_dict=True, zero_division=0)
    return {k.replace(" ", "_") if k in ("macro avg", "weighted avg", "micro avg") else k: v
            for k, v in report.items()}


def get_confusion_matrix(true_labels: Any, pred_labels: Any, target_names: Optional[Sequence[str]] = None,
                         filename: Optional[str] = None, normalization: bool = True, plot: bool = False,
                         title: str = "Confusion Matrix") -> Any:
    """The confusion matrix (rows: true class, columns: predicted), each row divided by its
    total when ``normalization`` (a class with no sample: a row of zeros).

    With ``filename`` (or ``plot``) it is also drawn (:func:`plot_confusion_matrix`) and
    written there as PNG.
    """
    import numpy as np

    metrics = deps.sklearn_metrics()
    deps.same_length(true_labels=true_labels, pred_labels=pred_labels)
    labels = _labels(true_labels, pred_labels, None, target_names)
    matrix = metrics.confusion_matrix(true_labels, pred_labels, labels=labels)
    if normalization:
        totals = matrix.sum(axis=1, keepdims=True)
        matrix = np.divide(matrix, totals, out=np.zeros(matrix.shape, dtype=np.float64), where=totals > 0)
    if plot or filename:
        names = list(target_names) if target_names is not None else [str(x) for x in labels]
        fig = plot_confusion_matrix(matrix, names, title, normalization=normalization)
        deps.save(fig, filename)
    return matrix


def plot_confusion_matrix(conf_matrix: Any, labels_name: Sequence[str], title: str,
                          normalization: bool = True, filename: Optional[str] = None) -> Any:
    """Draw a confusion matrix (a cell per pair, its value written in it); return the Figure
    (written to ``filename`` as PNG when given)."""
    import numpy as np

    matrix = np.asarray(conf_matrix)
    n = len(labels_name)
    if matrix.shape != (n, n):
        raise ValueError(f"conf_matrix of shape {matrix.shape} for {n} labels_name")
    size = max(4.0, 0.55 * n + 2.5)
    fig = deps.figure(size + 1.0, size)
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(matrix, interpolation="nearest", cmap="Blues", vmin=0, vmax=1 if normalization else None)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    ax.set_title(title)
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xticklabels(labels_name, rotation=45, ha="right")
    ax.set_yticklabels(labels_name)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if n <= 30:
        top = matrix.max() if matrix.size else 0
        for i in range(n):
            for j in range(n):
                value = matrix[i, j]
                text = f"{value:.2f}" if normalization else f"{int(value)}"
                ax.text(j, i, text, ha="center", va="center", fontsize=8,
                        color="white" if top and value > top / 2 else "black")
    deps.save(fig, filename)
    return fig
