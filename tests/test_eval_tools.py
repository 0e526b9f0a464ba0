"""The original's eval_tools (names and arguments of basetrainer 1.0.4): figures equal
scikit-learn's on the same predictions, verification checked against a brute-force count."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from basetrainer.metric.eval_tools import acc, classification_report, metrics, pr, roc, verification

from conftest import ROOT

sk = pytest.importorskip("sklearn.metrics")
PY = sys.executable


def _predictions(n=300, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    logits = rng.normal(size=(n, classes)) + 2.0 * np.eye(classes)[y]
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return y, probs


def _png(path):
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        assert im.format == "PNG" and im.size[0] > 200 and im.size[1] > 200
        return im.size


def test_classification_report_equals_scikit_learn():
    y, probs = _predictions()
    pred = probs.argmax(1)
    names = ["cat", "dog", "fox", "owl"]
    got = classification_report.get_classification_report(y, pred, target_names=names, output_dict=True)
    ref = sk.classification_report(y, pred, target_names=names, output_dict=True)
    assert {"macro_avg", "weighted_avg", "accuracy"} <= set(got)
    assert got["accuracy"] == ref["accuracy"] == sk.accuracy_score(y, pred)
    for name in names:
        assert got[name] == ref[name]
    assert got["macro_avg"] == ref["macro avg"] and got["weighted_avg"] == ref["weighted avg"]
    text = classification_report.get_classification_report(y, pred, target_names=names)
    assert isinstance(text, str) and "owl" in text and "macro avg" in text


def test_confusion_matrix_is_scikit_learns_normalised_by_true_class(tmp_path):
    y, probs = _predictions()
    pred = probs.argmax(1)
    path = str(tmp_path / "cm.png")
    got = classification_report.get_confusion_matrix(y, pred, target_names=list("abcd"), filename=path)
    assert np.allclose(got, sk.confusion_matrix(y, pred, normalize="true"), rtol=0, atol=1e-15)
    assert np.allclose(got.sum(1), 1.0)
    _png(path)
    counts = classification_report.get_confusion_matrix(y, pred, target_names=list("abcd"), normalization=False)
    assert np.array_equal(counts, sk.confusion_matrix(y, pred))
    # a class with no sample: a row of zeros (not NaN)
    m = classification_report.get_confusion_matrix([0, 0, 1], [0, 1, 1], target_names=["a", "b", "c"])
    assert np.array_equal(m[2], [0, 0, 0]) and np.allclose(m[0], [0.5, 0.5, 0])


def test_roc_equals_scikit_learn_and_invert_reads_distances(tmp_path):
    y, probs = _predictions(classes=2)
    score = probs[:, 1]
    fpr, tpr, value, thresholds, best = roc.get_roc_curve(y, score, plot_roc=False)
    ref_fpr, ref_tpr, ref_thr = sk.roc_curve(y, score, drop_intermediate=False)
    assert np.array_equal(fpr, ref_fpr) and np.array_equal(tpr, ref_tpr) and np.array_equal(thresholds, ref_thr)
    assert value == pytest.approx(sk.roc_auc_score(y, score), abs=1e-12)
    assert best == int(np.argmax(ref_tpr - ref_fpr))
    distance = 1.0 - score                   # lower = positive
    f2, t2, v2, thr2, _ = roc.get_roc_curve(y, distance, invert=True, plot_roc=True, filename=str(tmp_path / "roc.png"))
    assert v2 == pytest.approx(value, abs=1e-12)
    assert np.allclose(thr2[1:], 1.0 - thresholds[1:])   # in the distances' own units
    _png(str(tmp_path / "roc.png"))
    assert roc.get_tpr_fpr(fpr, tpr, 0.1) == tpr[fpr <= 0.1][-1]
    with pytest.raises(ValueError, match="both classes"):
        roc.get_roc_curve([1, 1, 1], [0.2, 0.5, 0.9])
    with pytest.raises(ValueError, match="one entry per sample"):
        roc.get_roc_curve([0, 1, 1], [0.2, 0.5])


def test_pr_curve_and_its_auc_equal_scikit_learn(tmp_path):
    y, probs = _predictions(classes=2, seed=4)
    precision, recall, value = pr.plot_classification_pr_curve(y, probs[:, 1], filename=str(tmp_path / "pr.png"))
    ref_p, ref_r, _ = sk.precision_recall_curve(y, probs[:, 1])
    assert np.array_equal(precision, ref_p) and np.array_equal(recall, ref_r)
    assert value == sk.auc(ref_r, ref_p)
    _png(str(tmp_path / "pr.png"))
    pred = (probs[:, 1] > 0.5).astype(int)
    p, r, a = pr.get_precision_recall_acc(y, pred)
    assert (p, r, a) == (sk.precision_score(y, pred), sk.recall_score(y, pred), sk.accuracy_score(y, pred))
    iou = np.where(y == 1, 0.8, 0.2)
    _, _, det = pr.plot_object_detection_pr_curve(iou, probs[:, 1], 0.5, plot_pr=False)
    assert det == value


def test_accuracy_against_threshold_is_the_brute_force_maximum(tmp_path):
    y, probs = _predictions(classes=2, seed=2)
    score = probs[:, 1]
    grid = np.linspace(0, 1, 101)
    best_acc, best_t = acc.get_accuracy_list(y, score, grid, filename=str(tmp_path / "acc.png"))
    brute = [np.mean((score >= t) == (y == 1)) for t in grid]
    assert best_acc == max(brute) and best_t == grid[int(np.argmax(brute))]
    inv_acc, inv_t = acc.get_accuracy_list(y, 1 - score, grid, invert=True, plot_acc=False)
    assert inv_acc == max(np.mean((1 - score <= t) == (y == 1)) for t in grid)
    _png(str(tmp_path / "acc.png"))


def test_topk_accuracy_is_in_percent_and_equals_scikit_learn():
    y, probs = _predictions(n=257, classes=6, seed=3)
    top1, top3 = metrics.accuracy(torch.tensor(probs), torch.tensor(y), topk=(1, 3))
    assert top1.item() == pytest.approx(100 * sk.top_k_accuracy_score(y, probs, k=1), abs=1e-4)
    assert top3.item() == pytest.approx(100 * sk.top_k_accuracy_score(y, probs, k=3), abs=1e-4)
    with pytest.raises(ValueError, match="classes"):
        metrics.accuracy(torch.tensor(probs), torch.tensor(y) + 1, topk=(1,))   # a label 6 for 6 classes
    with pytest.raises(ValueError, match="exceed"):
        metrics.accuracy(torch.tensor(probs), torch.tensor(y), topk=(7,))


def test_average_meter_weights_by_samples():
    m = metrics.AverageMeter()
    m.update(1.0, 3)
    m.update(torch.tensor(3.0), 1)
    assert (m.val, m.sum, m.count, m.avg) == (3.0, 6.0, 4, 1.5)
    multi = metrics.MultiAverageMeter(["loss"])
    multi.update({"loss": 2.0, "acc": 50.0}, 2)
    assert multi["loss"].avg == 2.0 and multi["acc"].count == 2


# ----------------------------------------------------------------------------- verification
def _pairs(n_pairs=600, dim=32, seed=0):
    """Same pairs: one identity plus noise; different pairs: two identities. Normalised."""
    rng = np.random.default_rng(seed)
    same = rng.random(n_pairs) < 0.5
    a = rng.normal(size=(n_pairs, dim))
    b = np.where(same[:, None], a + 1.5 * rng.normal(size=(n_pairs, dim)), rng.normal(size=(n_pairs, dim)))
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    b /= np.linalg.norm(b, axis=1, keepdims=True)
    emb = np.empty((2 * n_pairs, dim))
    emb[0::2], emb[1::2] = a, b
    return emb, same


def _brute_force(emb, same, folds, far_target):
    """Counted another way: distances as 2 - 2 cos, folds by array_split, each threshold's
    correct calls counted from the sorted distances."""
    a, b = emb[0::2], emb[1::2]
    dist = 2.0 - 2.0 * np.einsum("ij,ij->i", a, b)
    parts = np.array_split(np.arange(len(same)), folds)
    grid = np.arange(0, 4, 0.01)
    fine = np.arange(0, 4, 0.001)
    accs, bests, vals, fars = [], [], [], []
    for k in range(folds):
        test = parts[k]
        train = np.concatenate([p for j, p in enumerate(parts) if j != k])
        d, s = dist[train], same[train]
        order = np.argsort(d)
        ds, ss = d[order], s[order]
        below = np.searchsorted(ds, grid, side="left")          # pairs called "same" at each threshold
        same_below = np.concatenate([[0], np.cumsum(ss)])[below]
        diff_below = below - same_below
        correct = same_below + ((~s).sum() - diff_below)
        t = grid[int(np.argmax(correct))]
        bests.append(t)
        accs.append(np.mean((dist[test] < t) == same[test]))
        below_f = np.searchsorted(ds, fine, side="left")
        far_train = (below_f - np.concatenate([[0], np.cumsum(ss)])[below_f]) / (~s).sum()
        ok = np.nonzero(far_train <= far_target)[0]
        tf = fine[ok[-1]] if len(ok) else 0.0
        dt, st = dist[test], same[test]
        vals.append(np.sum((dt < tf) & st) / st.sum())
        fars.append(np.sum((dt < tf) & ~st) / (~st).sum())
    return np.array(accs), np.array(bests), np.mean(vals), np.std(vals), np.mean(fars)


@pytest.mark.slow
@pytest.mark.parametrize("folds", [10, 7])
def test_verification_equals_an_independent_count(folds):
    emb, same = _pairs()
    result = verification.evaluate(emb, same, nrof_folds=folds)
    tpr, fpr, accuracy, best_thresholds = result            # unpacks as the original
    assert len(accuracy) == folds and tpr.shape == fpr.shape == (400,)
    ref_acc, ref_best, tar, tar_std, far = _brute_force(emb, same, folds, 1e-3)
    assert np.allclose(accuracy, ref_acc, rtol=0, atol=1e-12)
    assert np.allclose(best_thresholds, ref_best, rtol=0, atol=1e-12)
    assert result.tar == pytest.approx(tar, abs=1e-12) and result.tar_std == pytest.approx(tar_std, abs=1e-12)
    assert result.far == pytest.approx(far, abs=1e-12) and result.far <= 0.01
    assert 0.8 < result.accuracy_mean < 1.0 and 0.0 < result.tar < 1.0
    assert result.summary()["folds"] == folds


def test_verification_refuses_embeddings_and_labels_of_different_lengths():
    emb, same = _pairs(n_pairs=40)
    with pytest.raises(ValueError, match="2 embeddings per pair label"):
        verification.evaluate(emb, same[:-3])
    with pytest.raises(ValueError, match="2 embeddings per pair label"):
        verification.evaluate(emb[:-1], same)
    with pytest.raises(ValueError, match="nrof_folds"):
        verification.evaluate(emb, same, nrof_folds=41)
    with pytest.raises(ValueError, match="NaN"):
        verification.evaluate(np.full_like(emb, np.nan), same)


def test_pca_option_runs_on_each_folds_training_part():
    emb, same = _pairs(n_pairs=200, dim=16, seed=1)
    result = verification.evaluate(emb, same, nrof_folds=5, pca=8)
    assert 0.7 < result.accuracy_mean <= 1.0


# ----------------------------------------------------------------------------- imports
@pytest.mark.distributed
def test_importing_the_tools_imports_neither_scikit_learn_nor_matplotlib():
    code = ("import sys; import basetrainer.metric.eval_tools.roc, basetrainer.metric.eval_tools.verification, "
            "basetrainer.metric.eval_tools.classification_report; "
            "print(sorted(m for m in ('sklearn', 'matplotlib', 'torchmetrics') if m in sys.modules))")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_a_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.metrics", None)
    with pytest.raises(ImportError, match=r'pip install "basetrainer\[eval\]"'):
        roc.get_roc_curve([0, 1], [0.1, 0.9])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="matplotlib.*basetrainer\\[eval\\]"):
        roc.plot_roc_curve([[0, 1]], [[0, 1]], [0.5], ["x"])
