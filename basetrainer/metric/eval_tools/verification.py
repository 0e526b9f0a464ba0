"""Face verification on pairs of embeddings, k-fold (as basetrainer 1.0.4 named it).

``embeddings`` holds the pairs one after the other: rows ``2i`` and ``2i + 1`` are pair i, and
``actual_issame[i]`` says whether they show the same identity. The distance of a pair is the
squared Euclidean distance of its embeddings (in ``[0, 4]`` for L2-normalised embeddings), and
a pair is called "same" when its distance is *below* the threshold. Over ``nrof_folds``
contiguous folds (``sklearn.model_selection.KFold`` without shuffling), each fold's threshold is
chosen on the other folds and measured on it:

- accuracy: the threshold of ``np.arange(0, 4, 0.01)`` with the best accuracy on the other
  folds (the first of equals);
- TAR at a FAR (``far_target``, default 1e-3): the largest threshold of
  ``np.arange(0, 4, 0.001)`` whose false accept rate on the other folds is at most
  ``far_target``; the true accept rate (TAR, "VAL") and FAR measured on the fold.
"""
import logging
from typing import Any, Dict, Optional, Tuple

import numpy as np

from basetrainer.metric.eval_tools import deps

logger = logging.getLogger(__name__)


class VerificationResult(tuple):
    """``(tpr, fpr, accuracy, best_thresholds)`` as the original returned, and as attributes:
    ``tpr``/``fpr`` (mean over folds, per threshold), ``accuracy`` and ``best_thresholds`` (per
    fold), ``tar``, ``tar_std`` and ``far`` (TAR at ``far_target``: mean and deviation over the
    folds, the FAR reached), ``accuracy_mean``, ``accuracy_std``, ``best_threshold``."""

    def __new__(cls, tpr: Any, fpr: Any, accuracy: Any, best_thresholds: Any, tar: float, tar_std: float,
                far: float, far_target: float, nrof_folds: int) -> "VerificationResult":
        self = super().__new__(cls, (tpr, fpr, accuracy, best_thresholds))
        self.tpr, self.fpr, self.accuracy, self.best_thresholds = tpr, fpr, accuracy, best_thresholds
        self.tar, self.tar_std, self.far = tar, tar_std, far
        self.far_target, self.nrof_folds = far_target, nrof_folds
        return self

    @property
    def accuracy_mean(self) -> float:
        return float(np.mean(self.accuracy))

    @property
    def accuracy_std(self) -> float:
        return float(np.std(self.accuracy))

    @property
    def best_threshold(self) -> float:
        return float(np.mean(self.best_thresholds))

    def summary(self) -> Dict[str, float]:
        return {"accuracy": self.accuracy_mean, "accuracy_std": self.accuracy_std,
                "best_threshold": self.best_threshold, "tar": float(self.tar), "tar_std": float(self.tar_std),
                "far": float(self.far), "far_target": float(self.far_target), "folds": int(self.nrof_folds)}


def _distance(embeddings1: Any, embeddings2: Any) -> Any:
    diff = embeddings1 - embeddings2
    return np.sum(np.square(diff), axis=1)


def _folds(n: int, nrof_folds: int) -> Any:
    KFold = deps.need("sklearn.model_selection", "verification.evaluate").KFold
    return KFold(n_splits=nrof_folds, shuffle=False).split(np.arange(n))


def _pca_distances(embeddings1: Any, embeddings2: Any, train: Any, pca: int) -> Any:
    """Distances after a PCA fitted on the training folds' embeddings, then L2 normalisation."""
    decomposition = deps.need("sklearn.decomposition", "verification.evaluate(pca=...)")
    preprocessing = deps.need("sklearn.preprocessing", "verification.evaluate(pca=...)")
    model = decomposition.PCA(n_components=pca)
    model.fit(np.concatenate((embeddings1[train], embeddings2[train])))
    e1 = preprocessing.normalize(model.transform(embeddings1))
    e2 = preprocessing.normalize(model.transform(embeddings2))
    return _distance(e1, e2)


def calculate_accuracy(threshold: float, dist: Any, actual_issame: Any) -> Tuple[float, float, float]:
    """``tpr, fpr, acc`` of calling pairs with ``dist < threshold`` the same."""
    predict = np.less(dist, threshold)
    same = np.asarray(actual_issame, dtype=bool)
    tp = np.sum(predict & same)
    fp = np.sum(predict & ~same)
    tn = np.sum(~predict & ~same)
    fn = np.sum(~predict & same)
    tpr = 0.0 if tp + fn == 0 else float(tp) / float(tp + fn)
    fpr = 0.0 if fp + tn == 0 else float(fp) / float(fp + tn)
    acc = float(tp + tn) / max(1, dist.size)
    return tpr, fpr, acc


def calculate_val_far(threshold: float, dist: Any, actual_issame: Any) -> Tuple[float, float]:
    """``val, far``: the true accept rate (of same pairs) and false accept rate (of different
    pairs) of ``dist < threshold``."""
    predict = np.less(dist, threshold)
    same = np.asarray(actual_issame, dtype=bool)
    n_same, n_diff = np.sum(same), np.sum(~same)
    val = 0.0 if n_same == 0 else float(np.sum(predict & same)) / float(n_same)
    far = 0.0 if n_diff == 0 else float(np.sum(predict & ~same)) / float(n_diff)
    return val, far


def calculate_roc(thresholds: Any, embeddings1: Any, embeddings2: Any, actual_issame: Any, nrof_folds: int = 10,
                  pca: int = 0) -> Tuple[Any, Any, Any, Any]:
    """``tpr, fpr`` per threshold (mean over the folds' test parts), ``accuracy`` and
    ``best_thresholds`` per fold (chosen on the other folds)."""
    thresholds = np.asarray(thresholds, dtype=np.float64)
    same = np.asarray(actual_issame, dtype=bool)
    n = min(len(same), embeddings1.shape[0])
    tprs = np.zeros((nrof_folds, len(thresholds)))
    fprs = np.zeros((nrof_folds, len(thresholds)))
    accuracy = np.zeros(nrof_folds)
    best_thresholds = np.zeros(nrof_folds)
    dist = _distance(embeddings1, embeddings2)
    for fold, (train, test) in enumerate(_folds(n, nrof_folds)):
        if pca > 0:
            dist = _pca_distances(embeddings1, embeddings2, train, pca)
        acc_train = np.array([calculate_accuracy(t, dist[train], same[train])[2] for t in thresholds])
        best = int(np.argmax(acc_train))
        best_thresholds[fold] = thresholds[best]
        for i, t in enumerate(thresholds):
            tprs[fold, i], fprs[fold, i], _ = calculate_accuracy(t, dist[test], same[test])
        accuracy[fold] = calculate_accuracy(thresholds[best], dist[test], same[test])[2]
    return np.mean(tprs, 0), np.mean(fprs, 0), accuracy, best_thresholds


def calculate_val(thresholds: Any, embeddings1: Any, embeddings2: Any, actual_issame: Any, far_target: float,
                  nrof_folds: int = 10) -> Tuple[float, float, float]:
    """``val_mean, val_std, far_mean``: TAR at ``far_target`` over the folds (the threshold: the
    largest of ``thresholds`` whose FAR on the other folds is at most ``far_target``)."""
    thresholds = np.asarray(thresholds, dtype=np.float64)
    same = np.asarray(actual_issame, dtype=bool)
    n = min(len(same), embeddings1.shape[0])
    val = np.zeros(nrof_folds)
    far = np.zeros(nrof_folds)
    dist = _distance(embeddings1, embeddings2)
    for fold, (train, test) in enumerate(_folds(n, nrof_folds)):
        far_train = np.array([calculate_val_far(t, dist[train], same[train])[1] for t in thresholds])
        allowed = np.nonzero(far_train <= far_target)[0]
        threshold = thresholds[allowed[-1]] if len(allowed) else 0.0
        val[fold], far[fold] = calculate_val_far(threshold, dist[test], same[test])
    return float(np.mean(val)), float(np.std(val)), float(np.mean(far))


def evaluate(embeddings: Any, actual_issame: Any, nrof_folds: int = 10, pca: int = 0,
             far_target: float = 1e-3) -> VerificationResult:
    """Verification accuracy and TAR at ``far_target`` of embedding pairs, ``nrof_folds``-fold.

    Args:
        embeddings: ``[2 * pairs, dim]``; rows ``2i`` and ``2i + 1`` are pair i (L2-normalise them
            first: the thresholds span ``[0, 4)``).
        actual_issame: a bool per pair.
        nrof_folds: folds (2 <= folds <= pairs).
        pca: reduce to this many components (fitted on each fold's training part) first; 0 = no.
        far_target: the false accept rate of the TAR figure.

    Returns:
        A :class:`VerificationResult`: unpacks as ``tpr, fpr, accuracy, best_thresholds``.

    Raises:
        ValueError: embeddings that are not ``[2 * len(actual_issame), dim]``, a bad fold count.
    """
    emb = deps.as_numpy(embeddings, "embeddings", np.float64)
    same = deps.as_numpy(actual_issame, "actual_issame").astype(bool).reshape(-1)
    if emb.ndim != 2:
        raise ValueError(f"embeddings must be [2 * pairs, dim]; got shape {emb.shape}")
    if emb.shape[0] != 2 * len(same):
        raise ValueError(f"embeddings and actual_issame do not match: {emb.shape[0]} embeddings hold "
                         f"{emb.shape[0] / 2:g} pairs, but actual_issame has {len(same)} labels (rows 2i and 2i+1 "
                         f"are pair i: give 2 embeddings per pair label)")
    if isinstance(nrof_folds, bool) or not isinstance(nrof_folds, int) or not 2 <= nrof_folds <= len(same):
        raise ValueError(f"nrof_folds={nrof_folds!r} must be an integer from 2 to the number of pairs ({len(same)})")
    if not np.all(np.isfinite(emb)):
        raise ValueError("embeddings hold NaN or infinite values")
    e1, e2 = emb[0::2], emb[1::2]
    dist = _distance(e1, e2)
    if dist.size and dist.max() >= 4.0:
        logger.warning("verification: pair distances reach %.3g, past the thresholds' range [0, 4): "
                       "L2-normalise the embeddings first", float(dist.max()))
    tpr, fpr, accuracy, best = calculate_roc(np.arange(0, 4, 0.01), e1, e2, same, nrof_folds, pca)
    tar, tar_std, far = calculate_val(np.arange(0, 4, 0.001), e1, e2, same, far_target, nrof_folds)
    return VerificationResult(tpr, fpr, accuracy, best, tar, tar_std, far, far_target, nrof_folds)
