"""evaluate() and predict() where they meet EMA, the run's test phase, EvalReport, resume and a
user's loader (found by the hostile pass of 2026-11-28): the weights and figures each uses equal
a hand computation, and a call that would corrupt the run is refused with the fix."""
import json
import logging
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.eval_report import EvalReport
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.model_ema import ModelEMA
from basetrainer.engine.trainer import EngineTrainer
from basetrainer.metric.accuracy_recorder import AccuracyRecorder
from basetrainer.utils import setup_config


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


class _Trainer(EngineTrainer):
    def __init__(self, cfg, callbacks):
        self._cbs = callbacks
        super().__init__(cfg)
        self.build(cfg)

    def build_train_loader(self, cfg, **kwargs):
        return self.build_dataloader(_data(24, 1), cfg.batch_size, 0, phase="train")

    def build_test_loader(self, cfg, **kwargs):
        return self.build_dataloader(_data(10, 2), cfg.batch_size, 0, phase="test")

    def build_model(self, cfg, **kwargs):
        torch.manual_seed(0)
        return self.build_model_parallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), cfg.gpu_id)

    def build_criterion(self, cfg, **kwargs):
        return nn.CrossEntropyLoss()

    def build_optimizer(self, cfg, **kwargs):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def build_callbacks(self, cfg, **kwargs):
        return [AccuracyRecorder(indicator="Accuracy"), LossesRecorder(indicator="loss")] + self._cbs(self)


def _cfg(tmp_path, **kw):
    return setup_config.Config(dict(dict(work_dir=str(tmp_path / "run"), batch_size=4, num_epochs=2, gpu_id=[], seed=1,
                                         log_freq=1000, num_workers=0, progress=False), **kw))


def _forward(weights, x):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model.load_state_dict(weights)
    with torch.no_grad():
        return model(x)


def test_predict_runs_on_the_ema_average_that_evaluate_tests(tmp_path):
    ema = ModelEMA(decay=0.5)
    trainer = _Trainer(_cfg(tmp_path), lambda t: [ema])
    trainer.run()
    x, y = _data(10, 2).tensors
    average, live = _forward(ema.ema, x), _forward(trainer.unwrapped_model.state_dict(), x)
    assert (average - live).abs().max() > 1e-3   # the two differ: the test can tell them apart
    predicted = trainer.predict(_data(10, 2))
    assert torch.allclose(predicted, average, atol=1e-6), (predicted - average).abs().max()
    figures = trainer.evaluate()
    assert figures["test/Accuracy"] == pytest.approx((predicted.argmax(1) == y).float().mean().item())
    # afterwards the model holds the live weights again
    assert torch.allclose(_forward(trainer.unwrapped_model.state_dict(), x), live)
    # with checkpoint=, the file's weights, as evaluate(checkpoint=) (no average swapped in over them)
    path = str(tmp_path / "live.pth")
    torch.save(trainer.unwrapped_model.state_dict(), path)
    assert torch.allclose(trainer.predict(_data(10, 2), checkpoint=path), live, atol=1e-6)


class _EvaluateAt(Callback):
    def __init__(self, event):
        self.event = event

    def on_test_end(self, logs=None):
        if self.event == "on_test_end":
            self.trainer.evaluate(_data(5, 3))

    def on_epoch_end(self, epoch, logs=None):
        if self.event == "on_epoch_end":
            self.figures = self.trainer.evaluate(_data(5, 3))


def test_evaluate_inside_the_runs_test_phase_is_refused_with_the_fix(tmp_path):
    trainer = _Trainer(_cfg(tmp_path), lambda t: [_EvaluateAt("on_test_end")])
    with pytest.raises(RuntimeError, match=r"evaluate\(\) was called inside run\(\)'s test phase .* call it from "
                                           r"on_epoch_end, or after run\(\)"):
        trainer.run()


def test_evaluate_from_on_epoch_end_leaves_the_runs_figures_and_weights(tmp_path):
    ema, inside = ModelEMA(decay=0.5), _EvaluateAt("on_epoch_end")
    reference = _Trainer(_cfg(tmp_path / "a"), lambda t: [ModelEMA(decay=0.5)])
    expected = [{k: v for k, v in e.items() if k.startswith("test/")} for e in reference.run().epochs]
    trainer = _Trainer(_cfg(tmp_path / "b"), lambda t: [ema, inside])
    got = [{k: v for k, v in e.items() if k.startswith("test/")} for e in trainer.run().epochs]
    assert got == expected
    assert all(torch.equal(a, b) for a, b in zip(trainer.unwrapped_model.state_dict().values(),
                                                 reference.unwrapped_model.state_dict().values()))
    x, y = _data(5, 3).tensors
    assert inside.figures["test/Accuracy"] == pytest.approx((_forward(ema.ema, x).argmax(1) == y).float().mean().item())


def test_evaluate_writes_its_report_beside_the_runs_not_over_it(tmp_path):
    trainer = _Trainer(_cfg(tmp_path), lambda t: [EvalReport(cam_images=0)])
    trainer.run()
    folder = tmp_path / "run" / "eval"
    run_report = json.loads((folder / "report.json").read_text())
    assert run_report["num_samples"] == 10
    trainer.evaluate(_data(5, 3))
    assert json.loads((folder / "report.json").read_text()) == run_report
    assert json.loads((folder / "evaluate" / "report.json").read_text())["num_samples"] == 5


def test_a_trainer_made_with_resume_says_evaluate_uses_build_models_weights(tmp_path, caplog):
    _Trainer(_cfg(tmp_path), lambda t: []).run()
    fresh = _Trainer(_cfg(tmp_path, resume="auto"), lambda t: [])
    with caplog.at_level(logging.WARNING):
        fresh.evaluate()
    assert "resume='auto' applies to run(), which has not run: the weights used are build_model's; " \
           "pass checkpoint='auto'" in caplog.text


def test_evaluate_refuses_a_loader_that_drops_samples(tmp_path):
    trainer = _Trainer(_cfg(tmp_path), lambda t: [])
    with pytest.raises(ValueError, match=r"drops its last incomplete batch \(drop_last=True\), so 1 of its 10 "
                                         r"samples would not count"):
        trainer.evaluate(DataLoader(_data(10, 2), batch_size=3, drop_last=True))
    assert trainer.evaluate(DataLoader(_data(10, 2), batch_size=5, drop_last=True))["test/Accuracy"] >= 0   # none dropped


class _EvaluateFile(Callback):
    """At each epoch end, evaluate() or predict() another set with a file's weights."""

    def __init__(self, what, path):
        self.what, self.path = what, path

    def on_epoch_end(self, epoch, logs=None):
        call = self.trainer.evaluate if self.what == "evaluate" else self.trainer.predict
        call(_data(5, 3), checkpoint=self.path)


@pytest.mark.parametrize("what", ["evaluate", "predict"])
def test_a_checkpoint_evaluated_from_on_epoch_end_does_not_replace_the_weights_being_trained(tmp_path, what):
    reference = _Trainer(_cfg(tmp_path / "a"), lambda t: [])
    expected = [{k: v for k, v in e.items() if k.startswith(("train/", "test/"))} for e in reference.run().epochs]
    other = str(tmp_path / "other.pth")
    torch.manual_seed(5)
    torch.save(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).state_dict(), other)
    trainer = _Trainer(_cfg(tmp_path / "b"), lambda t: [_EvaluateFile(what, other)])
    got = [{k: v for k, v in e.items() if k.startswith(("train/", "test/"))} for e in trainer.run().epochs]
    assert got == expected
    assert all(torch.equal(a, b) for a, b in zip(trainer.unwrapped_model.state_dict().values(),
                                                 reference.unwrapped_model.state_dict().values()))


class _Raises(Callback):
    def __init__(self, event):
        self.event = event

    def on_test_summary(self, *args, **kwargs):
        if self.event == "test":
            raise RuntimeError("fails on purpose")

    def on_predict_begin(self, logs=None):
        if self.event == "predict":
            raise RuntimeError("fails on purpose")


@pytest.mark.parametrize("event", ["test", "predict"])
def test_an_evaluation_that_raises_leaves_the_live_weights_not_the_ema_average(tmp_path, event):
    ema, failing = ModelEMA(decay=0.5), _Raises("none")
    trainer = _Trainer(_cfg(tmp_path), lambda t: [ema, failing])
    trainer.run()
    live = {k: v.clone() for k, v in trainer.unwrapped_model.state_dict().items()}
    failing.event = event
    with pytest.raises(RuntimeError, match="fails on purpose"):
        trainer.evaluate() if event == "test" else trainer.predict(_data(10, 2))
    assert all(torch.equal(live[k], v) for k, v in trainer.unwrapped_model.state_dict().items())
    failing.event = "none"   # and the next call swaps the average in and out again
    x = _data(10, 2).tensors[0]
    assert torch.allclose(trainer.predict(_data(10, 2)), _forward(ema.ema, x), atol=1e-6)
    assert all(torch.equal(live[k], v) for k, v in trainer.unwrapped_model.state_dict().items())


def test_dict_batches_that_predict_flattens_are_refused(tmp_path):
    class Dicts(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            x, y = _data(10, 2)[i]
            return {"x": x, "y": y}

    class Flat(_Trainer):
        def predict_step(self, batch):
            return self.model(batch["x"]).reshape(-1)

    trainer = Flat(_cfg(tmp_path), lambda t: [])
    with pytest.raises(ValueError, match=r"predict_step returned 12 rows for a batch of 4 samples"):
        trainer.predict(Dicts())
