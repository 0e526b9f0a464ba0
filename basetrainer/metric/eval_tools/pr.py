"""Precision, recall and precision-recall curves (scikit-learn), as basetrainer 1.0.4 named them."""
from typing import Any, Optional, Sequence, Tuple

from basetrainer.metric.eval_tools import deps


def get_precision(true_labels: Any, pred_labels: Any, average: str = "binary") -> Any:
    """``sklearn.metrics.precision_score`` (0 where nothing is predicted positive)."""
    return deps.sklearn_metrics().precision_score(true_labels, pred_labels, average=average, zero_division=0)


def get_recall(true_labels: Any, pred_labels: Any, average: str = "binary") -> Any:
    """``sklearn.metrics.recall_score``."""
    return deps.sklearn_metrics().recall_score(true_labels, pred_labels, average=average, zero_division=0)


def get_accuracy(true_labels: Any, pred_labels: Any) -> float:
    """``sklearn.metrics.accuracy_score``."""
    return float(deps.sklearn_metrics().accuracy_score(true_labels, pred_labels))


def get_precision_recall_acc(true_labels: Any, pred_labels: Any, average: str = "binary") -> Tuple[Any, Any, float]:
    """``precision, recall, accuracy`` of predicted labels."""
    return (get_precision(true_labels, pred_labels, average), get_recall(true_labels, pred_labels, average),
            get_accuracy(true_labels, pred_labels))


def plot_pr_curve(recall_list: Sequence[Any], precision_list: Sequence[Any], auc_list: Sequence[float],
                  line_names: Sequence[str], filename: Optional[str] = None, title: str = "Precision-Recall") -> Any:
    """Draw precision-recall curves (one per entry, the AUC in the legend); return the Figure."""
    if not len(recall_list) == len(precision_list) == len(auc_list) == len(line_names):
        raise ValueError("recall_list, precision_list, auc_list and line_names must be of the same length")
    fig = deps.figure(6.4, 5.6)
    ax = fig.add_subplot(1, 1, 1)
    for recall, precision, value, name in zip(recall_list, precision_list, auc_list, line_names):
        ax.plot(recall, precision, lw=1.5, label=f"{name} (AUC {value:.4f})")
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("recall")
    ax.set_ylabel("precision")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8 if len(line_names) > 6 else 10)
    deps.save(fig, filename)
    return fig


def get_classification_precision_recall(y_true: Any, probas_pred: Any) -> Tuple[Any, Any, float]:
    """``precision, recall, AUC``: ``sklearn.metrics.precision_recall_curve`` and the area under
    it (``sklearn.metrics.auc`` of recall and precision)."""
    metrics = deps.sklearn_metrics()
    deps.same_length(y_true=y_true, probas_pred=probas_pred)
    precision, recall, _ = metrics.precision_recall_curve(y_true, probas_pred)
    return precision, recall, float(metrics.auc(recall, precision))


def get_object_detection_precision_recall(iou_data: Any, probas_pred: Any, iou_threshold: float) -> Tuple[Any, Any, float]:
    """As :func:`get_classification_precision_recall`, a detection counting as positive when its
    IoU with the ground truth is at least ``iou_threshold``."""
    iou = deps.as_numpy(iou_data, "iou_data", float)
    return get_classification_precision_recall((iou >= iou_threshold).astype(int), probas_pred)


def plot_classification_pr_curve(true_label: Any, prob_data: Any, invert: bool = False, plot_pr: bool = True,
                                 filename: Optional[str] = None, name: str = "PR") -> Tuple[Any, Any, float]:
    """``precision, recall, AUC`` of scores (``invert``: lower scores mean positive), drawn when
    ``plot_pr`` (written to ``filename`` when given)."""
    scores = deps.as_numpy(prob_data, "prob_data", float)
    precision, recall, value = get_classification_precision_recall(true_label, -scores if invert else scores)
    if plot_pr or filename:
        deps.save(plot_pr_curve([recall], [precision], [value], [name]), filename)
    return precision, recall, value


def plot_object_detection_pr_curve(iou_data: Any, prob_data: Any, iou_threshold: float, plot_pr: bool = True,
                                   filename: Optional[str] = None) -> Tuple[Any, Any, float]:
    """:func:`get_object_detection_precision_recall`, drawn when ``plot_pr``."""
    precision, recall, value = get_object_detection_precision_recall(iou_data, prob_data, iou_threshold)
    if plot_pr or filename:
        deps.save(plot_pr_curve([recall], [precision], [value], [f"IoU >= {iou_threshold}"]), filename)
    return precision, recall, value
