"""Accuracy against a decision threshold, as basetrainer 1.0.4 named it."""
from typing import Any, List, Optional, Sequence, Tuple

from basetrainer.metric.eval_tools import deps


def get_accuracy_list(y_true: Any, y_pred: Any, threshold_list: Sequence[float], invert: bool = False,
                      plot_acc: bool = True, filename: Optional[str] = None) -> Tuple[float, float]:
    """Accuracy of the decision ``score >= threshold`` (``score <= threshold`` when ``invert``,
    e.g. for distances) at each threshold (``sklearn.metrics.accuracy_score``).

    Returns:
        ``max_acc, best_threshold`` (the first threshold reaching the highest accuracy).
    """
    import numpy as np

    metrics = deps.sklearn_metrics()
    y_true = deps.as_numpy(y_true, "y_true")
    scores = deps.as_numpy(y_pred, "y_pred", float)
    deps.same_length(y_true=y_true, y_pred=scores)
    thresholds = list(threshold_list)
    if not thresholds:
        raise ValueError("threshold_list is empty: give the thresholds to try")
    accs: List[float] = []
    for t in thresholds:
        decided = (scores <= t) if invert else (scores >= t)
        accs.append(float(metrics.accuracy_score(y_true, decided.astype(y_true.dtype if y_true.dtype != bool else bool))))
    best = int(np.argmax(accs))
    if plot_acc or filename:
        deps.save(plot_acc_curve([accs], thresholds, ["accuracy"]), filename)
    return accs[best], thresholds[best]


def plot_acc_curve(acc_list: Sequence[Sequence[float]], threshold_list: Sequence[float], line_names: Sequence[str],
                   title: str = "Accuracy-Threshold", filename: Optional[str] = None) -> Any:
    """Draw accuracy against threshold (one curve per entry of ``acc_list``); return the Figure."""
    if len(acc_list) != len(line_names):
        raise ValueError("acc_list and line_names must be of the same length")
    fig = deps.figure()
    ax = fig.add_subplot(1, 1, 1)
    for accs, name in zip(acc_list, line_names):
        best = max(range(len(accs)), key=lambda i: accs[i])
        ax.plot(threshold_list, accs, lw=1.5, label=f"{name} (max {accs[best]:.4f} at {threshold_list[best]:.4g})")
    ax.set_xlabel("threshold")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    deps.save(fig, filename)
    return fig
