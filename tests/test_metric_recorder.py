"""MetricRecorder (torchmetrics) and FunctionRecorder: figures on hand-made tensors, DDP equal to
one process on data that does not divide, a resume inside an epoch, dict batches and outputs,
the checkpoint mode told by the metric, and no optional import at ``import basetrainer``."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.early_stopping import EarlyStopping
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.metric import metric_states
from basetrainer.metric.metric_recorder import FunctionRecorder, MetricRecorder
from basetrainer.runtime import comm

from conftest import ROOT, StopAt, ToyTrainer, run_distributed, toy_cfg

tm = pytest.importorskip("torchmetrics")
from torchmetrics import MetricCollection  # noqa: E402
from torchmetrics.aggregation import CatMetric, MaxMetric, MeanMetric, MinMetric, SumMetric  # noqa: E402
from torchmetrics.classification import (MulticlassAccuracy, MulticlassAUROC, MulticlassF1Score,  # noqa: E402
                                         MulticlassJaccardIndex)
from torchmetrics.regression import ExplainedVariance, MeanAbsoluteError  # noqa: E402


# ----------------------------------------------------------------------------- toys
def noisy_blobs(n, seed, num_classes=4, dim=16):
    """Overlapping blobs: a tiny model gets some wrong, so every figure is a real fraction."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_classes, dim, generator=torch.Generator().manual_seed(1234))
    y = torch.arange(n) % num_classes
    return TensorDataset(centres[y] + 1.5 * torch.randn(n, dim, generator=g), y)


class NoisyTrainer(ToyTrainer):
    def build_train_loader(self, cfg, **kwargs):
        return self.build_dataloader(noisy_blobs(cfg.n_train, 0), cfg.batch_size, 0, phase="train", shuffle=True)

    def build_test_loader(self, cfg, **kwargs):
        return self.build_dataloader(noisy_blobs(cfg.n_test, 1), cfg.batch_size, 0, phase="test", shuffle=False)


def logit0_vs_label(outputs, targets):
    """A regression-shaped pair for MeanAbsoluteError: the first logit against the label."""
    return outputs[:, 0], targets.float()


def recorders():
    return [MetricRecorder(MeanAbsoluteError(), "MAE", transform=logit0_vs_label),
            MetricRecorder(MulticlassJaccardIndex(4), "IoU"),
            MetricRecorder(MetricCollection({"acc": MulticlassAccuracy(4, average="micro"),
                                             "f1": MulticlassF1Score(4, average="macro"),
                                             "auroc": MulticlassAUROC(4)}), "cls"),   # "cat" states
            FunctionRecorder(lambda out, y: (out.argmax(1) == y).float(), "hit"),       # per sample
            FunctionRecorder(lambda out, y: nn.functional.cross_entropy(out, y), "ce"),  # batch mean
            *one_input_recorders()]


def one_input_recorders():
    """torchmetrics' one-input metrics, each reading one thing of a step (see ONE_INPUT)."""
    return [MetricRecorder(MeanMetric(), "mean_logit0", transform=lambda out, y: out[:, 0]),
            MetricRecorder(MeanMetric(), "wmean_logit1", transform=lambda out, y: (out[:, 1], y.float() + 1)),
            MetricRecorder(MaxMetric(), "max_logit"),                      # every entry of the outputs
            MetricRecorder(MinMetric(), "min_logit"),
            MetricRecorder(SumMetric(), "sum_label", reads="targets"),
            MetricRecorder(CatMetric(), "cat_hit", transform=lambda out, y: (out.argmax(1) == y).float())]


# what torchmetrics gives for each of them on a phase's (outputs, targets)
ONE_INPUT = {"mean_logit0": lambda out, y: MeanMetric()(out[:, 0]),
             "wmean_logit1": lambda out, y: MeanMetric()(out[:, 1], y.float() + 1),
             "max_logit": lambda out, y: MaxMetric()(out),
             "min_logit": lambda out, y: MinMetric()(out),
             "sum_label": lambda out, y: SumMetric()(y),
             "cat_hit": lambda out, y: CatMetric()((out.argmax(1) == y).float()).mean()}

FIGURES = ["MAE", "IoU", "acc", "f1", "auroc", "hit", "ce", *ONE_INPUT]


def fake_trainer(log=False, test=True):
    return SimpleNamespace(train_loader=object(), test_loader=object() if test else None,
                           should_log=lambda batch: log, model=None, device=torch.device("cpu"))


def feed(rec, phase, batches, trainer=None):
    """One phase of ``rec`` over ``batches`` = [(inputs, outputs), ...]; returns the logs."""
    rec.set_trainer(trainer or fake_trainer())
    logs = {}
    rec.on_train_begin(logs)
    rec.on_epoch_begin(0, logs)
    for b, (inputs, outputs) in enumerate(batches):
        if phase == "train":
            rec.on_train_summary(inputs, outputs, None, 0, b, logs)
    rec.on_test_begin(logs)
    for b, (inputs, outputs) in enumerate(batches):
        if phase == "test":
            rec.on_test_summary(inputs, outputs, None, 0, b, logs)
    rec.on_test_end(logs)
    return logs


# ----------------------------------------------------------------------------- figures on tensors
def test_figures_equal_torchmetrics_on_the_whole_data_and_phases_restrict():
    g = torch.Generator().manual_seed(0)
    batches = [((torch.zeros(n, 2), torch.randint(0, 3, (n,), generator=g)), torch.randn(n, 3, generator=g))
               for n in (5, 3, 7)]
    preds = torch.cat([o for _, o in batches])
    targets = torch.cat([i[1] for i, _ in batches])
    iou = MulticlassJaccardIndex(3)(preds, targets).item()
    per_class = MulticlassJaccardIndex(3, average=None)(preds, targets)
    logs = feed(MetricRecorder(MulticlassJaccardIndex(3), "IoU", phases=("test",)), "test", batches)
    assert logs == {"test/IoU": pytest.approx(iou, rel=1e-6)}
    logs = feed(MetricRecorder(MulticlassJaccardIndex(3, average=None), "IoU", per_class=True), "train", batches)
    assert set(logs) == {"train/IoU", "train/IoU_0", "train/IoU_1", "train/IoU_2"}   # the rule for several values
    assert logs["train/IoU"] == pytest.approx(per_class.mean().item(), rel=1e-6)
    assert logs["train/IoU_1"] == pytest.approx(per_class[1].item(), rel=1e-6)
    logs = feed(MetricRecorder(MulticlassJaccardIndex(3), "IoU", phases="train"), "test", batches)
    assert logs == {}   # "train" only: the test phase writes nothing


def test_function_recorder_weights_scalars_by_batch_size_and_per_sample_values_by_count():
    batches = [((torch.zeros(3, 2), torch.tensor([1.0, 2.0, 3.0])), torch.zeros(3)),
               ((torch.zeros(1, 2), torch.tensor([10.0])), torch.zeros(1))]
    per_sample = feed(FunctionRecorder(lambda o, t: (t - o).abs(), "L1"), "test", batches)
    batch_mean = feed(FunctionRecorder(lambda o, t: (t - o).abs().mean(), "L1"), "test", batches)
    assert per_sample["test/L1"] == pytest.approx(16 / 4)     # not the mean of batch means, (2 + 10) / 2
    assert batch_mean["test/L1"] == pytest.approx(16 / 4)


def test_running_train_figure_at_log_points_is_this_ranks_and_a_new_epoch_starts_from_zero():
    rec = MetricRecorder(MeanAbsoluteError(), "MAE")
    rec.set_trainer(fake_trainer(log=False))
    logs = {}
    rec.on_train_begin(logs)
    rec.on_epoch_begin(0, logs)
    rec.on_train_summary((torch.zeros(2, 1), torch.tensor([1.0, 3.0])), torch.zeros(2), None, 0, 0, logs)
    assert "train/MAE" not in logs
    rec.trainer.should_log = lambda batch: True
    rec.on_train_summary((torch.zeros(1, 1), torch.tensor([5.0])), torch.zeros(1), None, 0, 1, logs)
    assert logs["train/MAE"] == pytest.approx(3.0)
    rec.on_epoch_begin(1, logs)
    rec.on_train_summary((torch.zeros(1, 1), torch.tensor([1.0])), torch.zeros(1), None, 1, 0, logs)
    assert logs["train/MAE"] == pytest.approx(1.0)


# ----------------------------------------------------------------------------- dict batches, dict outputs
def test_dict_batches_with_target_key_and_segmentation_dict_outputs():
    g = torch.Generator().manual_seed(1)
    out = {"aux": torch.randn(2, 3, 4, 4, generator=g), "out": torch.randn(2, 3, 4, 4, generator=g)}
    batch = {"image": torch.zeros(2, 1, 4, 4), "mask": torch.randint(0, 3, (2, 4, 4), generator=g)}
    logs = feed(MetricRecorder(MulticlassJaccardIndex(3), "mIoU", target_key="mask"), "test", [(batch, out)])
    assert logs["test/mIoU"] == pytest.approx(MulticlassJaccardIndex(3)(out["out"], batch["mask"]).item(), rel=1e-6)
    logs = feed(MetricRecorder(MulticlassJaccardIndex(3), "mIoU", target_key="mask", output_key="aux"),
                "test", [(batch, out)])
    assert logs["test/mIoU"] == pytest.approx(MulticlassJaccardIndex(3)(out["aux"], batch["mask"]).item(), rel=1e-6)
    logs = feed(FunctionRecorder(lambda o, t: (o.argmax(1) == t).float(), "pix", target_key="mask"),
                "test", [(batch, out)])
    assert logs["test/pix"] == pytest.approx((out["out"].argmax(1) == batch["mask"]).float().mean().item())
    # a tuple output gives its first element
    logs = feed(MetricRecorder(MulticlassJaccardIndex(3), "mIoU", target_key="mask"), "test",
                [(batch, (out["aux"], out["out"]))])
    assert logs["test/mIoU"] == pytest.approx(MulticlassJaccardIndex(3)(out["aux"], batch["mask"]).item(), rel=1e-6)


def test_every_recorder_reads_the_same_entry_of_dict_outputs_and_refuses_an_ambiguous_dict():
    """{"emb", "logits"} outputs: AccuracyRecorder read "logits", MetricRecorder and
    FunctionRecorder the first value, "emb": 0.525 against 0.325 on the same run, silently
    (hostile pass). One rule now: output_key; a dict's "logits", else "out", else its only entry."""
    from basetrainer.metric.accuracy_recorder import AccuracyRecorder

    y = torch.tensor([0, 1, 2, 0])
    logits = torch.eye(3)[[0, 1, 2, 1]] * 5          # 3 of 4 right
    emb = torch.eye(3)[[1, 2, 0, 1]] * 5             # none right
    batches = [((torch.zeros(4, 2), y), {"emb": emb, "logits": logits})]

    def recorders(**key):
        return [AccuracyRecorder(indicator="acc", **key),
                MetricRecorder(MulticlassAccuracy(3, average="micro"), "acc", **key),
                FunctionRecorder(lambda o, t: (o.argmax(1) == t).float(), "acc", **key)]

    assert [feed(r, "test", batches)["test/acc"] for r in recorders()] == pytest.approx([0.75] * 3)
    assert [feed(r, "test", batches)["test/acc"] for r in recorders(output_key="emb")] == pytest.approx([0.0] * 3)
    only = [((torch.zeros(4, 2), y), {"scores": logits})]
    assert [feed(r, "test", only)["test/acc"] for r in recorders()] == pytest.approx([0.75] * 3)
    ambiguous = [((torch.zeros(4, 2), y), {"emb": emb, "scores": logits})]
    for r, name in zip(recorders(), ("AccuracyRecorder", "MetricRecorder", "FunctionRecorder")):
        with pytest.raises(ValueError, match=rf"^{name} 'acc': the model's outputs are a dict of \['emb', 'scores'\], "
                                             rf"with no 'logits' or 'out' entry to read by default: give output_key= "
                                             rf"the key of the predictions \(e\.g\. output_key='emb'\)$"):
            feed(r, "test", ambiguous)
    # the rule goes on into a tuple's (or list's) first entry: ({"logits", "aux"}, aux) and [{"out"}]
    # (AccuracyRecorder failed with "'dict' object has no attribute 'detach'" on them)
    for wrapped in (({"logits": logits, "aux": emb}, emb), [{"out": logits}]):
        nested = [((torch.zeros(4, 2), y), wrapped)]
        assert [feed(r, "test", nested)["test/acc"] for r in recorders()] == pytest.approx([0.75] * 3)
    nested = [((torch.zeros(4, 2), y), ({"logits": logits, "emb": emb}, emb))]
    assert [feed(r, "test", nested)["test/acc"] for r in recorders(output_key="emb")] == pytest.approx([0.0] * 3)


def test_bad_input_is_an_early_error_naming_the_argument_and_the_fix():
    with pytest.raises(TypeError, match="metric=.*torchmetrics Metric or MetricCollection.*FunctionRecorder"):
        MetricRecorder(lambda o, t: o, "x")
    with pytest.raises(ValueError, match=r"phases=\('val',\).*'train', 'test'"):
        MetricRecorder(MeanAbsoluteError(), "MAE", phases=("val",))
    with pytest.raises(ValueError, match="indicator=''.*non-empty"):
        MetricRecorder(MetricCollection([MeanAbsoluteError()]), "")
    with pytest.raises(ValueError, match="indicator=''"):
        FunctionRecorder(lambda o, t: o, "")
    batch = {"image": torch.zeros(2, 1), "mask": torch.zeros(2)}
    with pytest.raises(KeyError, match=r"target_key='label'.*\['image', 'mask'\].*set target_key"):
        feed(MetricRecorder(MeanAbsoluteError(), "MAE", target_key="label"), "test", [(batch, torch.zeros(2))])
    with pytest.raises(KeyError, match=r"output_key='logits'.*\['aux', 'out'\]"):
        feed(MetricRecorder(MeanAbsoluteError(), "MAE", output_key="logits"), "test",
             [((torch.zeros(2), torch.zeros(2)), {"out": torch.zeros(2), "aux": torch.zeros(2)})])

    class Custom(tm.Metric):
        def __init__(self):
            super().__init__()
            self.add_state("x", torch.zeros(()), dist_reduce_fx=lambda t: t.prod(0))

        def update(self, p, t):
            pass

        def compute(self):
            return self.x
    with pytest.raises(ValueError, match="state 'x' has dist_reduce_fx=.*'sum', 'cat', 'min', 'max' or 'mean'"):
        MetricRecorder(Custom(), "custom")


@pytest.mark.distributed
def test_import_of_basetrainer_imports_no_optional_package_and_a_missing_torchmetrics_says_what_to_install():
    code = ("import sys, basetrainer\nfrom basetrainer.engine import trainer\n"
            "from basetrainer.metric import metric_recorder\n"
            "print(sorted(m for m in ('torchmetrics', 'mlflow', 'wandb') if m in sys.modules))\n"
            "sys.modules['torchmetrics'] = None   # as if not installed\n"
            "try:\n    metric_recorder.MetricRecorder(object(), 'x')\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    imported, error = out.stdout.strip().splitlines()
    assert imported == "[]"
    assert 'pip install "basetrainer[metrics]"' in error


# ----------------------------------------------------------------------------- the mode of "best"
def test_checkpoint_and_early_stopping_take_the_mode_from_the_metric(tmp_path):
    # "score" reads as "max" by its name; MeanAbsoluteError says lower is better
    checkpoints = [ModelCheckpoint(model_dir=str(tmp_path / "a"), indicator="score", start_save=0),
                   ModelCheckpoint(model_dir=str(tmp_path / "b"), indicator="MAE", start_save=0),
                   ModelCheckpoint(model_dir=str(tmp_path / "c"), indicator="score", start_save=0, mode="max"),
                   ModelCheckpoint(model_dir=str(tmp_path / "d"), indicator="err_rate", start_save=0)]
    stops = [EarlyStopping("score", patience=10), EarlyStopping("test/err_rate", patience=10)]
    assert [c.mode for c in checkpoints] == ["max", "min", "max", "min"]   # the name rule, before the run
    recs = [MetricRecorder(MeanAbsoluteError(), "score", transform=logit0_vs_label),
            MetricRecorder(MeanAbsoluteError(), "MAE", transform=logit0_vs_label),
            MetricRecorder(MulticlassAccuracy(4), "err_rate")]   # a name the rule gets wrong: max
    t = NoisyTrainer(toy_cfg(n_train=64, n_test=32, num_epochs=3, lr=0.05), callbacks=recs + checkpoints + stops)
    history = t.run()
    assert [c.mode for c in checkpoints] == ["min", "min", "max", "max"]   # an explicit mode wins
    assert [s.mode for s in stops] == ["min", "max"]
    scores = history["test/score"]
    assert len(set(scores)) == 3
    assert checkpoints[0].best == min(scores) and checkpoints[2].best == max(scores)
    assert stops[0].best == min(scores)
    assert checkpoints[3].best == max(history["test/err_rate"])


# ----------------------------------------------------------------------------- exact over DDP ranks, resume
# One 2-rank launch does all the distributed work of this file (each spawned process pays seconds
# of imports); the tests below read its results.
def _train(work, extra=(), resume=""):
    # 101 samples, global batch 20: each rank trains 50 or 51 samples (its last step holds one
    # sample or none) and tests 51 or 50 samples in 6 or 5 batches of 10
    cfg = toy_cfg(n_train=101, n_test=101, batch_size=20, num_epochs=2, lr=0.05, work_dir=work, resume=resume,
                  distributed=comm.get_world_size() > 1)
    ckpt = ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="MAE", save_freq_steps=1, async_save=False)
    return NoisyTrainer(cfg, callbacks=recorders() + [ckpt, *extra]).run().epochs


class Running(Callback):
    """The running train figure this rank published at each log step (before the phase end)."""

    def __init__(self):
        super().__init__()
        self.values = []

    def on_batch_end(self, batch, logs=None):
        if self.trainer.should_log(batch):
            self.values.append(logs["train/MAE"])


class Capture(Callback):
    """Every step's (outputs, targets) of each phase of each epoch, on the CPU."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def _keep(self, phase, epoch, inputs, outputs):
        self.seen.setdefault((epoch, phase), []).append((outputs.detach().cpu().clone(), inputs[1].cpu().clone()))

    def on_train_summary(self, inputs, outputs, losses, epoch, batch, logs=None):
        self._keep("train", epoch, inputs, outputs)

    def on_test_summary(self, inputs, outputs, losses, epoch, batch, logs=None):
        self._keep("test", epoch, inputs, outputs)

    def phases(self):
        return {key: (torch.cat([o for o, _ in steps]), torch.cat([y for _, y in steps]))
                for key, steps in self.seen.items()}


def _reduce_kinds(rank):
    """Every kind of state, with rank 1 seeing no batch of the "lonely" metric."""
    metrics = {"max": MaxMetric(sync_on_compute=False), "min": MinMetric(sync_on_compute=False),
               "mean": MeanMetric(sync_on_compute=False), "cat": CatMetric(sync_on_compute=False)}
    values = torch.tensor([[3.0, -1.0, 2.0], [7.0, 0.5, -4.0]])
    for m in metrics.values():
        if rank == 0 or comm.get_world_size() == 1:
            m.update(values[0])
        if rank == 1 or comm.get_world_size() == 1:
            m.update(values[1])
    # only rank 0 (or the one process) sees a batch; ExplainedVariance's summed states start as
    # scalars and take the shape [outputs] at the first update, so rank 1's stay scalars
    lonely = ExplainedVariance(multioutput="raw_values", sync_on_compute=False)
    if rank == 0:
        lonely.update(torch.tensor([[1.0, 0.0], [2.0, 1.0], [4.0, 1.0]]), torch.tensor([[1.0, 1.0], [3.0, 0.0], [4.0, 2.0]]))
    # one-input metrics that only rank 0 (or the one process) updates: rank 1's list state is empty
    alone = {"cat": CatMetric(sync_on_compute=False), "max": MaxMetric(sync_on_compute=False),
             "sum": SumMetric(sync_on_compute=False)}
    if rank == 0:
        for m in alone.values():
            m.update(torch.tensor([2.5, -1.5]))
            m.update(torch.tensor(4.0))
    out = {k: metric_states.compute_reduced(m, metric_states.reduce_states(m)) for k, m in metrics.items()}
    out["lonely"] = metric_states.compute_reduced(lonely, metric_states.reduce_states(lonely)).tolist()
    out["alone"] = {k: metric_states.compute_reduced(m, metric_states.reduce_states(m)).tolist()
                    for k, m in alone.items()}
    out["local_max"] = metrics["max"].compute()   # the local state stays this rank's
    return out


def _everything(rank, work):
    running, capture = Running(), Capture()
    full = _train(os.path.join(work, "full"), [running, capture])
    try:
        _train(os.path.join(work, "cut"), [StopAt(1, 2)])
    except RuntimeError as e:
        assert "stopped on purpose" in str(e)
    comm.synchronize()   # rank 0 has written the step's last.pth
    state = torch.load(os.path.join(work, "cut", "model", "last.pth"), weights_only=True)
    resumed = _train(os.path.join(work, "cut"), resume="auto")
    return {"full": full, "resumed": resumed, "saved": (state["epoch"], state["phase"], state["batch"]),
            "kinds": _reduce_kinds(rank), "running": running.values, "seen": capture.phases()}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _everything(0, str(tmp_path_factory.mktemp("single")))


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    work = tmp_path_factory.mktemp("ddp")
    return run_distributed(_everything, 2, work, str(work), timeout=300)


def _assert_same(one, two):
    assert len(one) == len(two)
    for a, b in zip(one, two):
        assert set(a) == set(b)
        for phase in ("train", "test"):
            for name in FIGURES:
                key = f"{phase}/{name}"
                if name in ("acc", "IoU", "f1"):   # from integer states: exactly
                    assert b[key] == a[key], key
                else:   # float sums in another order: a few float32 ulps of the logits (up to 2.6 here).
                    # abs=1e-7 failed on an AVX-512 Xeon (test/mean_logit0 0.14222245 vs 0.14222263:
                    # 1.8e-7, 1.5 ulps of 1.0), which the AMD machines before it passed; a sample
                    # counted twice or missed moves these figures by about 1 %
                    assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-6), key


@pytest.mark.distributed
def test_ddp_figures_equal_one_process_on_101_samples(single, ddp):
    for rank in ddp:   # every rank holds the reduced figures
        _assert_same(single["full"], rank["full"])
    # the running train figure is each rank's own (no collective in the loop): the ranks' differ
    assert len(ddp[0]["running"]) == len(ddp[1]["running"]) == 6
    assert all(a != b for a, b in zip(ddp[0]["running"], ddp[1]["running"]))
    last = single["full"][-1]
    assert 0.2 < last["test/acc"] < 0.95 and 0.2 < last["train/hit"] < 0.95 and last["test/MAE"] > 0   # real figures


@pytest.mark.distributed
def test_one_input_metrics_give_torchmetrics_figures_in_a_run_and_over_uneven_ranks(single, ddp):
    # one process: what torchmetrics gives on every step's outputs and targets of the phase
    for epoch, row in enumerate(single["full"]):
        for phase in ("train", "test"):
            out, y = single["seen"][(epoch, phase)]
            assert len(y) == 101
            for name, reference in ONE_INPUT.items():
                assert row[f"{phase}/{name}"] == pytest.approx(float(reference(out, y)), rel=1e-6), (epoch, phase, name)
    # 2 ranks (51 + 50 samples): every rank's figure is the whole data's (ONE_INPUT is in FIGURES,
    # so test_ddp_figures_equal_one_process_on_101_samples compares them too); by hand here
    for epoch in range(2):
        for phase in ("train", "test"):
            parts = [rank["seen"][(epoch, phase)] for rank in ddp]
            assert sorted(len(y) for _, y in parts) == [50, 51]
            out, y = torch.cat([o for o, _ in parts]), torch.cat([t for _, t in parts])
            for rank in ddp:
                for name, reference in ONE_INPUT.items():
                    assert rank["full"][epoch][f"{phase}/{name}"] == pytest.approx(float(reference(out, y)), rel=1e-6)
    assert single["full"][-1]["test/sum_label"] == sum(range(4)) * 25 + 0   # 101 labels i % 4: 25 of each + a 0


@pytest.mark.distributed
def test_states_reduce_by_their_kind_also_with_a_rank_that_saw_nothing(single, ddp):
    one = single["kinds"]
    assert (float(one["max"]), float(one["min"])) == (7.0, -4.0)
    assert one["lonely"] == pytest.approx([6 / 7, -1 / 3], rel=1e-6)   # by hand
    for r, rank in enumerate(ddp):
        out = rank["kinds"]
        for key in ("max", "min", "mean"):
            assert float(out[key]) == pytest.approx(float(one[key]), rel=1e-6), key
        assert out["lonely"] == pytest.approx(one["lonely"], rel=1e-6)
        assert sorted(out["cat"].tolist()) == sorted(one["cat"].tolist())
        assert out["alone"] == one["alone"] == {"cat": [2.5, -1.5, 4.0], "max": 4.0, "sum": 5.0}
        assert float(out["local_max"]) == (3.0 if r == 0 else 7.0)


@pytest.mark.distributed
def test_a_resume_inside_an_epoch_gives_the_uninterrupted_figures(single, ddp):
    for run in [single, *ddp]:
        assert run["saved"] == (1, "train", 3)       # stopped after 3 of the 6 steps of epoch 1
        assert [r["epoch"] for r in run["resumed"]] == [1]
        _assert_same(run["full"][1:], run["resumed"])   # the resumed epoch's train figures count every step once


# ----------------------------------------------------------------------------- one-input metrics
def _one_input_batches():
    g = torch.Generator().manual_seed(3)
    return [((torch.zeros(n, 2), torch.randint(0, 5, (n,), generator=g)), torch.randn(n, generator=g))
            for n in (4, 1, 6)]


def test_one_input_metrics_give_the_figure_torchmetrics_gives_on_the_same_values():
    batches = _one_input_batches()
    outputs = torch.cat([o for _, o in batches])
    targets = torch.cat([i[1] for i, _ in batches])
    cases = [  # (recorder, what torchmetrics gives on the whole epoch's values)
        (MetricRecorder(MeanMetric(), "m"), MeanMetric()(outputs)),               # the outputs by default
        (MetricRecorder(MaxMetric(), "m"), MaxMetric()(outputs)),
        (MetricRecorder(MinMetric(), "m"), MinMetric()(outputs)),
        (MetricRecorder(SumMetric(), "m"), SumMetric()(outputs)),
        (MetricRecorder(CatMetric(), "m"), CatMetric()(outputs).mean()),          # several values: their mean
        (MetricRecorder(MaxMetric(), "m", reads="targets"), MaxMetric()(targets.float())),
        (MetricRecorder(SumMetric(), "m", reads="targets"), SumMetric()(targets.float())),
        (MetricRecorder(MeanMetric(), "m", transform=lambda o, t: (o - t).abs()),
         MeanMetric()((outputs - targets).abs())),
        (MetricRecorder(MeanMetric(), "m", transform=lambda o, t: (o, t.float() + 1)),   # value and weight
         MeanMetric()(outputs, targets.float() + 1)),
    ]
    for rec, expected in cases:
        for phase in ("train", "test"):
            logs = feed(rec, phase, batches)
            assert logs[f"{phase}/m"] == pytest.approx(float(expected), rel=1e-6), (type(rec.metrics["train"]), phase)
    assert float(MeanMetric()(outputs)) != pytest.approx(float(MeanMetric()(outputs, targets.float())))  # not weights
    # a collection of one-input metrics reads one input too
    rec = MetricRecorder(MetricCollection({"hi": MaxMetric(), "lo": MinMetric()}), "range", reads="targets")
    logs = feed(rec, "test", batches)
    assert logs == {"test/hi": float(targets.max()), "test/lo": float(targets.min())}


def test_a_metric_the_recorder_cannot_drive_is_refused_when_built_naming_the_fix():
    from torchmetrics.retrieval import RetrievalMRR

    with pytest.raises(TypeError, match=r"MetricRecorder 'mrr'.*RetrievalMRR\.update\(preds.*indexes.*\) with "
                                        r"\(outputs, targets\).*'indexes'.*transform=lambda outputs, targets"):
        MetricRecorder(RetrievalMRR(), "mrr")
    rec = MetricRecorder(RetrievalMRR(), "mrr", transform=lambda o, t: (o, t, torch.arange(len(t)) // 2))
    batch = ((torch.zeros(4, 1), torch.tensor([1, 0, 0, 1])), torch.tensor([0.9, 0.1, 0.8, 0.3]))
    assert feed(rec, "test", [batch])["test/mrr"] == pytest.approx(0.75)   # groups {0,1}: 1, {2,3}: 1/2
    with pytest.raises(ValueError, match=r"reads='preds'.*'outputs' or 'targets'"):
        MetricRecorder(MaxMetric(), "m", reads="preds")
    with pytest.raises(TypeError, match=r"MeanAbsoluteError\.update\(preds.*target.*\) with \(targets\).*'target'.*"
                                        r"transform="):
        MetricRecorder(MeanAbsoluteError(), "MAE", reads="targets")
    with pytest.raises(ValueError, match="reads=.*transform.*not both"):
        MetricRecorder(MaxMetric(), "m", reads="targets", transform=lambda o, t: o)
    with pytest.raises(ValueError, match=r"MetricCollection.*'hi'.*one input.*'mae'.*two.*own MetricRecorder"):
        MetricRecorder(MetricCollection({"hi": MaxMetric(), "mae": MeanAbsoluteError()}), "mix")
    # wrappers whose figure is not in states of their own published nothing
    from torchmetrics.aggregation import RunningMean
    from torchmetrics.wrappers import BootStrapper, MinMaxMetric

    with pytest.raises(ValueError, match=r"RunningMean is a window of the last 5 updates.*record the metric it wraps"
                                         r" \(MeanMetric\)"):
        MetricRecorder(RunningMean(window=5), "run")
    for wrapper in (MinMaxMetric(MeanAbsoluteError()), BootStrapper(MeanAbsoluteError(), num_bootstraps=2)):
        with pytest.raises(ValueError, match=r"keeps its states in the metrics it wraps \(MeanAbsoluteError\)"):
            MetricRecorder(wrapper, "w", transform=lambda o, t: (o, t))
    # a transform that returns what the update cannot take: named at the first step, not deep in torchmetrics
    rec = MetricRecorder(MaxMetric(), "m", transform=lambda o, t: (o, t, t))
    with pytest.raises(TypeError, match=r"MetricRecorder 'm': MaxMetric\.update raised TypeError.*transform returned "
                                        r"3 values.*transform=lambda outputs, targets"):
        feed(rec, "test", _one_input_batches())


def test_the_update_gets_outputs_and_targets_unless_reads_or_transform_say_otherwise():
    """What update gets is chosen, not guessed from its parameters: ``update(preds, target=None)``
    got the outputs alone, since one of its two parameters had a default."""
    class Optional(tm.Metric):
        full_state_update = False

        def __init__(self):
            super().__init__()
            self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")

        def update(self, preds, target=None):
            self.total += preds.sum() if target is None else (preds * target).sum()

        def compute(self):
            return self.total

    batches = [((torch.zeros(2, 1), torch.tensor([2.0, 3.0])), torch.tensor([1.0, 10.0]))]
    assert feed(MetricRecorder(Optional(), "s"), "test", batches)["test/s"] == 32.0              # (outputs, targets)
    assert feed(MetricRecorder(Optional(), "s", reads="outputs"), "test", batches)["test/s"] == 11.0
    assert feed(MetricRecorder(Optional(), "s", reads="targets"), "test", batches)["test/s"] == 5.0
    assert feed(MetricRecorder(Optional(), "s", transform=lambda o, t: (o, o)), "test", batches)["test/s"] == 101.0


# ----------------------------------------------------------------------------- torchmetrics' public API
class _Watched(MeanAbsoluteError):
    """Records each write of one of its private fields made from outside torch and torchmetrics."""

    foreign = []

    def __setattr__(self, name, value):
        if name.startswith("_") and not name.startswith("__"):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not caller.startswith(("torch", "copy")):
                _Watched.foreign.append((caller, name))
        super().__setattr__(name, value)


def test_the_recorder_drives_torchmetrics_through_its_public_api_but_one_documented_write():
    g = torch.Generator().manual_seed(5)
    batches = [((torch.zeros(n, 2), torch.randn(n, generator=g)), torch.randn(n, generator=g)) for n in (4, 2, 5)]
    _Watched.foreign.clear()
    rec = MetricRecorder(_Watched(), "MAE")
    logs = feed(rec, "test", batches)
    expected = float(MeanAbsoluteError()(torch.cat([o for _, o in batches]), torch.cat([i[1] for i, _ in batches])))
    assert logs["test/MAE"] == pytest.approx(expected, rel=1e-6)
    reduced = metric_states.reduce_states(rec.metrics["test"])
    assert reduced[""]["count"] == 3
    assert float(metric_states.compute_reduced(rec.metrics["test"], reduced)) == pytest.approx(expected, rel=1e-6)
    fresh = _Watched()
    metric_states.load_states(fresh, reduced)   # a resume: states and the update count they came with
    assert fresh.update_count == 3 and float(fresh.compute()) == pytest.approx(expected, rel=1e-6)
    # the one write torchmetrics gives no public way for (see metric_states._restore_update_count)
    assert {name for _, name in _Watched.foreign} == {"_update_count"}, _Watched.foreign
    assert {caller for caller, _ in _Watched.foreign} == {"basetrainer.metric.metric_states"}
