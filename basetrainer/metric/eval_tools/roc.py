"""ROC curves and their AUC (scikit-learn), as basetrainer 1.0.4 named them."""
from typing import Any, Optional, Sequence, Tuple

from basetrainer.metric.eval_tools import deps


def get_roc_curve(y_true: Any, y_score: Any, invert: bool = False, plot_roc: bool = True,
                  filename: Optional[str] = None, name: str = "ROC") -> Tuple[Any, Any, float, Any, int]:
    """A binary ROC curve (``sklearn.metrics.roc_curve``) and its area (``sklearn.metrics.auc``).

    Args:
        y_true: 1 for a positive sample, 0 for a negative one.
        y_score: the scores (higher: more likely positive).
        invert: lower scores mean positive (e.g. distances); the thresholds returned stay in
            the scores' units.
        plot_roc: draw the curve (written to ``filename`` when given).

    Returns:
        ``fpr, tpr, roc_auc, threshold, optimal_idx``: the index of the threshold with the
        highest ``tpr - fpr`` (Youden's J).

    Raises:
        ValueError: lengths differ, or ``y_true`` holds a single class (no ROC curve exists).
    """
    import numpy as np

    metrics = deps.sklearn_metrics()
    y_true = deps.as_numpy(y_true, "y_true")
    y_score = deps.as_numpy(y_score, "y_score", float)
    deps.same_length(y_true=y_true, y_score=y_score)
    if len(np.unique(y_true)) != 2:
        raise ValueError(f"y_true must hold both classes (0 and 1) for a ROC curve; it holds {np.unique(y_true)}")
    fpr, tpr, threshold = metrics.roc_curve(y_true, -y_score if invert else y_score, drop_intermediate=False)
    if invert:
        threshold = -threshold
    roc_auc = float(metrics.auc(fpr, tpr))
    optimal_idx = int(np.argmax(tpr - fpr))
    if plot_roc or filename:
        fig = plot_roc_curve([fpr], [tpr], [roc_auc], [name])
        deps.save(fig, filename)
    return fpr, tpr, roc_auc, threshold, optimal_idx


def plot_roc_curve(fpr_list: Sequence[Any], tpr_list: Sequence[Any], roc_auc_list: Sequence[float],
                   line_names: Sequence[str], filename: Optional[str] = None, title: str = "ROC") -> Any:
    """Draw ROC curves (one per entry, the AUC in the legend); return the Figure."""
    if not len(fpr_list) == len(tpr_list) == len(roc_auc_list) == len(line_names):
        raise ValueError("fpr_list, tpr_list, roc_auc_list and line_names must be of the same length")
    fig = deps.figure(6.4, 5.6)
    ax = fig.add_subplot(1, 1, 1)
    for fpr, tpr, value, name in zip(fpr_list, tpr_list, roc_auc_list, line_names):
        ax.plot(fpr, tpr, lw=1.5, label=f"{name} (AUC {value:.4f})")
    ax.plot([0, 1], [0, 1], color="grey", lw=1, linestyle="--")
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8 if len(line_names) > 6 else 10)
    deps.save(fig, filename)
    return fig


def get_tpr_fpr(fpr: Any, tpr: Any, fixed_fpr: float = 0.01) -> float:
    """The true positive rate at the largest false positive rate <= ``fixed_fpr`` (0 if none)."""
    import numpy as np

    fpr, tpr = np.asarray(fpr), np.asarray(tpr)
    kept = tpr[fpr <= fixed_fpr]
    return float(kept[-1]) if len(kept) else 0.0
