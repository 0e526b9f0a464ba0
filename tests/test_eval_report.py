"""The evaluation report: figures equal scikit-learn's on the same predictions, the same report
from 1, 2 and 3 ranks, TensorBoard images and tracker artifacts, Grad-CAM, bad input."""
import importlib.util
import json
import os
import types

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.early_stopping import EarlyStopping
from basetrainer.callbacks.eval_report import EvalReport
from basetrainer.callbacks.log_history import LogHistory
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.trackers import Tracker
from basetrainer.evaluation.report import write_report
from basetrainer.metric.accuracy_recorder import AccuracyRecorder
from basetrainer.runtime import comm

from conftest import ToyTrainer, blobs, run_distributed, toy_cfg

sk = pytest.importorskip("sklearn.metrics")


def _png(path):
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        assert im.format == "PNG" and min(im.size) > 150
        return im.size


def _scores(n=400, c=5, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, c, n)
    logits = rng.normal(size=(n, c)) + 1.5 * np.eye(c)[y]
    return y, logits


# ----------------------------------------------------------------------------- the writer
def test_report_figures_equal_scikit_learns_on_the_same_predictions(tmp_path):
    y, logits = _scores()
    names = ["ant", "bee", "cat", "dog", "eel"]
    out = write_report(torch.tensor(logits), torch.tensor(y), str(tmp_path / "eval"), class_names=names, topk=(1, 3))
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    pred = probs.argmax(1)
    p, r, f, s = sk.precision_recall_fscore_support(y, pred, labels=range(5))
    for i, name in enumerate(names):
        row = out["per_class"][name]
        assert (row["precision"], row["recall"], row["f1-score"], row["support"]) == (p[i], r[i], f[i], s[i])
        positive = (y == i).astype(int)
        assert row["roc_auc"] == pytest.approx(sk.roc_auc_score(positive, probs[:, i]), abs=1e-12)
        prec, rec, _ = sk.precision_recall_curve(positive, probs[:, i])
        assert row["pr_auc"] == pytest.approx(sk.auc(rec, prec), abs=1e-12)
        assert row["average_precision"] == pytest.approx(sk.average_precision_score(positive, probs[:, i]), abs=1e-12)
    assert out["accuracy"] == sk.accuracy_score(y, pred)
    assert out["balanced_accuracy"] == pytest.approx(sk.balanced_accuracy_score(y, pred), abs=1e-12)
    assert out["top_k"]["top1"] == pytest.approx(sk.top_k_accuracy_score(y, probs, k=1), abs=1e-6)
    assert out["top_k"]["top3"] == pytest.approx(sk.top_k_accuracy_score(y, probs, k=3), abs=1e-6)
    assert out["roc_auc_macro"] == pytest.approx(sk.roc_auc_score(y, probs, multi_class="ovr"), abs=1e-12)
    assert out["confusion_matrix"] == sk.confusion_matrix(y, pred).tolist()
    macro = sk.precision_recall_fscore_support(y, pred, average="macro")
    assert out["macro_avg"]["f1-score"] == pytest.approx(macro[2], abs=1e-12)
    on_disk = json.load(open(out["files"]["json"]))
    assert on_disk["accuracy"] == out["accuracy"] and on_disk["per_class"]["eel"]["support"] == int(s[4])
    for name in ("confusion_matrix", "roc", "pr"):
        _png(out["files"][name])
    md = open(out["files"]["markdown"]).read()
    assert "| eel |" in md and "balanced accuracy" in md
    assert "macro avg" in open(out["files"]["classification_report"]).read()


def test_probabilities_are_taken_as_they_are_and_logits_through_a_softmax(tmp_path):
    y, logits = _scores(n=100, c=3, seed=1)
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    a = write_report(logits, y, str(tmp_path / "a"))
    b = write_report(probs, y, str(tmp_path / "b"))
    assert a["per_class"]["1"]["roc_auc"] == pytest.approx(b["per_class"]["1"]["roc_auc"], abs=1e-12)
    assert "top5" not in a["top_k"]         # more than the 3 classes: left out


def test_a_class_without_samples_has_no_curve_and_the_rest_stand(tmp_path):
    y, logits = _scores(n=120, c=4, seed=2)
    y[y == 3] = 0
    out = write_report(logits, y, str(tmp_path))
    assert out["per_class"]["3"]["support"] == 0 and out["per_class"]["3"]["roc_auc"] is None
    assert out["per_class"]["0"]["roc_auc"] is not None and out["roc_auc_macro"] is None


def test_bad_input_is_a_clear_error(tmp_path):
    y, logits = _scores(n=50, c=4)
    y[17] = 6
    with pytest.raises(ValueError, match=r"sample 17 has class 6.*outputs 4 classes.*num_classes >= 7"):
        write_report(logits, y, str(tmp_path))
    with pytest.raises(ValueError, match="one label per output"):
        write_report(logits, y[:40] % 4, str(tmp_path))
    with pytest.raises(ValueError, match="class_names holds 2 names"):
        write_report(logits, y % 4, str(tmp_path), class_names=["a", "b"])
    with pytest.raises(ValueError, match="integer class"):
        write_report(logits, (y % 4) + 0.5, str(tmp_path))
    with pytest.raises(ValueError, match="at least one sample"):
        write_report(np.zeros((0, 4)), np.zeros(0, int), str(tmp_path))


def test_the_report_reads_dict_outputs_by_the_recorders_rule():
    """It took a dict as it was and refused it ([batch, classes] scores needed); the recorders'
    rule now: a dict's "logits", else "out", else its only entry, else a ValueError naming the fix."""
    report = EvalReport()
    y, logits = torch.tensor([0, 1]), torch.randn(2, 3)
    report.on_test_begin()
    report.on_test_summary((torch.zeros(2, 4), y), {"emb": torch.randn(2, 3), "logits": logits}, None, 0, 0)
    report.on_test_summary((torch.zeros(2, 4), y), (logits, torch.zeros(2)), None, 0, 1)
    assert len(report._scores) == 2 and all(torch.equal(s, logits) for s in report._scores)
    with pytest.raises(ValueError, match=r"^EvalReport: the model's outputs are a dict of \['a', 'b'\].*: give "
                                         r"EvalReport\(outputs_fn=lambda outputs: outputs\[<key>\]\)$"):
        report.on_test_summary((torch.zeros(2, 4), y), {"a": logits, "b": logits}, None, 0, 2)


# ----------------------------------------------------------------------------- the callback
class FakeTracker(Tracker):
    name = "fake"

    def __init__(self):
        super().__init__()
        self.artifacts = []

    def _start(self, start_epoch): pass
    def _epoch(self, epoch, figures, global_step): pass
    def _step(self, global_step, figures): pass
    def _finish(self, done): pass
    def _artifacts(self, paths, folder): self.artifacts.append((folder, [os.path.basename(p) for p in paths]))


class Outputs(Callback):
    """The test outputs and labels of the last epoch, in the order this rank saw them."""

    def on_test_begin(self, logs=None):
        self.out, self.y = [], []

    def on_test_summary(self, inputs, outputs, losses, epoch, batch, logs=None):
        self.out.append(outputs.detach())
        self.y.append(inputs[1])


def _train_with_report(rank, work, n_test=241, extra=()):
    torch.set_num_threads(1)
    report = EvalReport(class_names=["a", "b", "c", "d"], topk=(1, 2))
    seen = Outputs()
    t = ToyTrainer(toy_cfg(num_epochs=2, n_train=64, n_test=n_test, work_dir=work, lr=0.1,
                           distributed=comm.get_world_size() > 1),
                   callbacks=[AccuracyRecorder(), report, seen, *extra])
    t.run()
    return {"report": report.last_report, "history": t.history.epochs}


def test_the_callback_reports_the_last_epoch_with_scikit_learns_figures(tmp_path):
    work = str(tmp_path / "run")
    tracker = FakeTracker()
    history = LogHistory(log_dir=os.path.join(work, "log"), log_freq=2, loggers=["tensorboard", tracker])
    out = _train_with_report(0, work, extra=(history,))
    rep = out["report"]
    assert rep["epoch"] == 1 and rep["num_samples"] == 241
    assert rep["accuracy"] == pytest.approx(out["history"][-1]["test/Accuracy"], abs=1e-12)
    # the same figures as scikit-learn on the model's test outputs of that epoch
    files = rep["files"]
    assert os.path.dirname(files["json"]) == os.path.join(work, "eval")
    for key in ("confusion_matrix", "roc", "pr"):
        _png(files[key])
    # TensorBoard holds the PNGs as images (x = the epoch), the tracker every file under eval/
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(work, "log"), size_guidance={"images": 0})
    events.Reload()
    assert {"eval/confusion_matrix", "eval/roc", "eval/pr"} <= set(events.Tags()["images"])
    assert events.Images("eval/roc")[0].step == 1
    assert tracker.artifacts and tracker.artifacts[0][0] == "eval"
    assert {"report.json", "report.md", "roc.png", "pr.png", "confusion_matrix.png"} <= set(tracker.artifacts[0][1])


def test_report_figures_equal_scikit_learn_on_the_callbacks_outputs(tmp_path):
    seen = Outputs()
    report = EvalReport()
    t = ToyTrainer(toy_cfg(num_epochs=1, n_train=64, n_test=97, work_dir=str(tmp_path)), callbacks=[report, seen])
    t.run()
    logits = torch.cat(seen.out).numpy()
    y = torch.cat(seen.y).numpy()
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    rep = report.last_report
    assert rep["confusion_matrix"] == sk.confusion_matrix(y, probs.argmax(1), labels=range(4)).tolist()
    assert rep["roc_auc_macro"] == pytest.approx(sk.roc_auc_score(y, probs, multi_class="ovr"), abs=1e-9)
    assert rep["balanced_accuracy"] == pytest.approx(sk.balanced_accuracy_score(y, probs.argmax(1)), abs=1e-12)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_the_report_over_2_and_3_ranks_equals_one_process(tmp_path, world):
    one = _train_with_report(0, str(tmp_path / "one"))["report"]
    many = run_distributed(_train_with_report, world, tmp_path, str(tmp_path / f"w{world}"), timeout=240)
    rep = many[0]["report"]
    assert all(r["report"] is None for r in many[1:])   # only the main process writes
    assert rep["num_samples"] == one["num_samples"] == 241
    assert rep["confusion_matrix"] == one["confusion_matrix"]
    for key in ("accuracy", "balanced_accuracy", "roc_auc_macro"):
        assert rep[key] == pytest.approx(one[key], abs=1e-6), key
    for name in "abcd":
        for key in ("precision", "recall", "support", "roc_auc", "average_precision"):
            assert rep["per_class"][name][key] == pytest.approx(one["per_class"][name][key], abs=1e-6)


@pytest.mark.slow
def test_every_epoch_writes_one_folder_per_epoch_and_an_early_stop_still_reports(tmp_path):
    report = EvalReport(every_epoch=True)
    t = ToyTrainer(toy_cfg(num_epochs=3, n_train=64, n_test=40, work_dir=str(tmp_path / "a")), callbacks=[report])
    t.run()
    assert sorted(os.listdir(tmp_path / "a" / "eval")) == ["epoch_001", "epoch_002", "epoch_003"]

    class StopAfterFirst(Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.trainer.stop_training = True

    report = EvalReport()
    t = ToyTrainer(toy_cfg(num_epochs=5, n_train=64, n_test=40, work_dir=str(tmp_path / "b")),
                   callbacks=[report, StopAfterFirst()])
    t.run()
    assert report.last_report["epoch"] == 0 and os.path.isfile(tmp_path / "b" / "eval" / "report.json")


def test_no_test_loader_is_a_clear_error(tmp_path):
    t = ToyTrainer(toy_cfg(num_epochs=1, n_train=32, n_test=0, work_dir=str(tmp_path)), callbacks=[EvalReport()])
    with pytest.raises(ValueError, match="no test loader"):
        t.run()


def _labels_beyond(rank, work):
    t = ToyTrainer(toy_cfg(num_epochs=1, n_train=32, n_test=41, num_classes=4, work_dir=work,
                           distributed=comm.get_world_size() > 1),
                   callbacks=[EvalReport()], model=_tiny(3))
    try:
        t.run()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _tiny(classes):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, classes))


def test_labels_the_models_classes_cannot_hold_are_refused(tmp_path):
    # train labels 3 with 3 outputs fail in the loss first; here the loss does not see them
    class Loose(ToyTrainer):
        def build_criterion(self, cfg, **kwargs):
            return lambda out, y: out.float().mean() * 0

    t = Loose(toy_cfg(num_epochs=1, n_train=32, n_test=41, num_classes=4, work_dir=str(tmp_path)),
              callbacks=[EvalReport()], model=_tiny(3))
    with pytest.raises(ValueError, match=r"class 3, but the model outputs 3 classes.*num_classes"):
        t.run()


# ----------------------------------------------------------------------------- Grad-CAM
class SmallCNN(nn.Module):
    def __init__(self, classes=3):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.3), nn.Linear(8, classes))

    def forward(self, x):
        return self.head(self.features(x))


def _images(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 3, 16, 16, generator=g) * 0.3
    for i in range(n):   # a bright square whose corner tells the class
        r = int(y[i]) * 5
        x[i, :, r:r + 6, r:r + 6] += 1.5
    return TensorDataset(x, y)


class ImageTrainer(ToyTrainer):
    def build_train_loader(self, cfg, **kwargs):
        return self.build_dataloader(_images(48, 0), cfg.batch_size, 0, phase="train")

    def build_test_loader(self, cfg, **kwargs):
        return self.build_dataloader(_images(30, 1), cfg.batch_size, 0, phase="test", shuffle=False)

    def build_model(self, cfg, **kwargs):
        torch.manual_seed(0)
        return self.build_model_parallel(SmallCNN(), cfg.gpu_id)


needs_torchcam = pytest.mark.skipif(importlib.util.find_spec("torchcam") is None,
                                    reason='torchcam not installed: pip install "basetrainer[eval]"')


@pytest.mark.slow
@needs_torchcam
def test_a_gradcam_grid_is_in_the_report_and_training_is_unchanged_by_it(tmp_path):
    runs = {}
    for cam in (0, 6):
        # SmoothGrad-CAM++ draws noise from torch's generator, which the dropout of training uses too
        report = EvalReport(every_epoch=True, cam_images=cam, class_names=["tl", "mid", "br"],
                            cam_type="SmoothGradCAMpp")
        t = ImageTrainer(toy_cfg(num_epochs=3, batch_size=8, work_dir=str(tmp_path / f"cam{cam}")), callbacks=[report])
        t.run()
        runs[cam] = {k: v.clone() for k, v in t.unwrapped_model.state_dict().items()}
        if cam:
            path = report.last_report["files"]["gradcam"]
            assert path == str(tmp_path / "cam6" / "eval" / "epoch_003" / "gradcam.png")
            _png(path)
    for k in runs[0]:   # the CAM's backward leaves no gradient and no random draw behind
        assert torch.equal(runs[0][k], runs[6][k]), k


@needs_torchcam
def test_torchcam_api_of_the_original(tmp_path):
    from basetrainer.utils.torchcam_utils import TorchCAM

    model = SmallCNN().eval()
    data = _images(4, 2)
    with TorchCAM(model, target_layer="features.2", input_shape=(3, 16, 16), cam_type="GradCAM") as cam:
        cam.set_image([x for x in data.tensors[0]])
        with torch.enable_grad():
            outputs = model(data.tensors[0])
        cam.set_outputs(outputs)
        featuremaps, heatmaps = cam.get_heatmap(out=str(tmp_path / "hm.png"))
    assert len(featuremaps) == 4 and featuremaps[0].shape == (16, 16) and heatmaps[0].shape == (16, 16, 3)
    assert 0.0 <= featuremaps[0].min() and featuremaps[0].max() <= 1.0
    assert os.path.getsize(tmp_path / "hm.png") > 0
    with pytest.raises(ValueError, match="cam_type"):
        TorchCAM(model, cam_type="Magic")
    with pytest.raises(ValueError, match="cam_type"):
        EvalReport(cam_images=2, cam_type="Magic")


class BatchNormCNN(nn.Module):
    """SmallCNN with a BatchNorm after each conv: a forward in train mode moves their statistics."""

    def __init__(self, classes=3):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.3), nn.Linear(8, classes))

    def forward(self, x):
        return self.head(self.features(x))


def _as_found(model):
    return ({k: v.clone() for k, v in model.state_dict().items()}, [(n, m.training) for n, m in model.named_modules()],
            [(n, p.requires_grad) for n, p in model.named_parameters()])


@needs_torchcam
@pytest.mark.parametrize("cam_type", ["GradCAM", "ScoreCAM"])
@pytest.mark.parametrize("how", ["explains", "under no_grad", "raises midway"])
def test_explain_leaves_a_training_model_with_batchnorm_as_it_found_it(cam_type, how):
    """explain() on a model in train mode moved its BatchNorm statistics (num_batches_tracked 0 -> 1):
    its state_dict, every module's mode and every parameter's requires_grad are as before, also
    when it raises after the forward; the maps are those of the model in eval mode (inference)."""
    from basetrainer.utils.torchcam_utils import TorchCAM

    from conftest import weight_diff

    torch.manual_seed(0)
    model = BatchNormCNN().train()
    model.features[4].eval()                    # a frozen BatchNorm in a training model
    model.features[0].requires_grad_(False)     # and a frozen first conv
    state, modes, flags = _as_found(model)
    x = _images(4, 2).tensors[0]
    with TorchCAM(model, target_layer="features.5", input_shape=(3, 16, 16), cam_type=cam_type) as cam:
        if how == "raises midway":               # class 7 of 3: torchcam refuses it after the forward
            with pytest.raises(Exception):
                cam.explain(x, class_idx=[7] * 4)
        else:
            with torch.no_grad() if how == "under no_grad" else torch.enable_grad():
                maps, _ = cam.explain(x)
    assert weight_diff(state, model.state_dict()) == 0.0
    assert int(model.features[1].num_batches_tracked) == 0
    assert [(n, m.training) for n, m in model.named_modules()] == modes
    assert [(n, p.requires_grad) for n, p in model.named_parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    if how != "raises midway":
        with TorchCAM(model.eval(), target_layer="features.5", input_shape=(3, 16, 16), cam_type=cam_type) as cam:
            in_eval, _ = cam.explain(x)
        assert len(maps) == 4 and all(np.array_equal(a, b) for a, b in zip(maps, in_eval))


@needs_torchcam
def test_cam_grid_puts_back_each_modules_own_mode(tmp_path):
    """cam_grid put a training model back with model.train(True): a frozen BatchNorm trained again."""
    from basetrainer.utils.torchcam_utils import cam_grid

    from conftest import weight_diff

    model = BatchNormCNN().train()
    model.features[1].eval()
    state, modes, _ = _as_found(model)
    data = _images(3, 2)
    cam_grid(model, data.tensors[0], data.tensors[1].tolist(), str(tmp_path / "grid.png"), target_layer="features.5")
    assert [(n, m.training) for n, m in model.named_modules()] == modes and not model.features[1].training
    assert weight_diff(state, model.state_dict()) == 0.0 and os.path.getsize(tmp_path / "grid.png") > 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason='mlflow not installed: pip install "basetrainer[mlflow]"')
def test_mlflow_receives_the_report_as_artifacts(tmp_path):
    from mlflow.tracking import MlflowClient

    from basetrainer.callbacks.mlflow_logger import MLflowLogger

    work = str(tmp_path / "run")
    uri = "sqlite:///" + os.path.join(work, "mlflow.db")
    tracker = MLflowLogger(uri=uri, log_best_model=False)
    _train_with_report(0, work, n_test=40,
                       extra=(LogHistory(log_dir=os.path.join(work, "log"), log_freq=2, loggers=[tracker]),))
    names = {os.path.basename(a.path) for a in MlflowClient(tracking_uri=uri).list_artifacts(tracker.run_id, "eval")}
    assert {"report.json", "report.md", "roc.png", "pr.png", "confusion_matrix.png"} <= names, names


def test_wandb_puts_the_files_in_one_artifact(monkeypatch, tmp_path):
    wandb = pytest.importorskip("wandb")
    from basetrainer.callbacks.wandb_logger import WandbLogger

    logged = []

    class Run:
        def log_artifact(self, artifact):
            logged.append(artifact)

    logger = WandbLogger()
    logger.run, logger.run_id = Run(), "abc"
    (tmp_path / "roc.png").write_bytes(b"png")
    (tmp_path / "report.json").write_text("{}")
    logger._artifacts([str(tmp_path / "roc.png"), str(tmp_path / "report.json")], "eval")
    assert len(logged) == 1 and logged[0].type == "evaluation"
    assert {"eval/roc.png", "eval/report.json"} <= set(logged[0].manifest.entries)


def test_without_log_history_or_work_dir_the_images_go_beside_the_report(tmp_path, monkeypatch):
    """TensorBoard's images of a report whose trainer has no LogHistory and no work_dir went to the
    current folder's log/ (test runs left log/ in the repository); they go beside the report."""
    monkeypatch.chdir(tmp_path)
    report = EvalReport(out_dir=str(tmp_path / "rep"))
    report.trainer = types.SimpleNamespace(cfg={}, callbacks=[])
    writer = report._tensorboard(None)
    writer.close()
    assert not (tmp_path / "log").exists()
    assert os.path.isdir(tmp_path / "rep" / "log") and os.listdir(tmp_path / "rep" / "log")
