"""Class-balanced resampling: the rule's per-class counts, a function of (seed, epoch); DDP on 2 and
3 ranks equals one process; SIGKILL inside an epoch then resume: auto equals the uninterrupted run;
the original's DataResample API; where labels come from; bad input."""
import collections
import math
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

from basetrainer.callbacks.callbacks import Callback
from basetrainer.dataloader.data_resample import ClassBalance, DataResample, class_targets, copy_epoch, labels_of
from basetrainer.dataloader.loader import build_dataloader
from basetrainer.dataloader.sampler import GlobalBatchSampler
from basetrainer.runtime import checkpoint, comm
from basetrainer.utils import setup_config

from conftest import ROOT, StopAt, ToyTrainer, make_image_folder, run_distributed, toy_cfg, weight_diff

PY = sys.executable
COUNTS = {0: 70, 1: 25, 2: 10, 3: 5}     # 110 samples


def _imbalanced(counts=COUNTS, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(len(counts), dim, generator=torch.Generator().manual_seed(1234)) * 3
    y = torch.cat([torch.full((n,), c) for c, n in counts.items()])
    y = y[torch.randperm(len(y), generator=g)]
    return TensorDataset(centres[y] + 0.8 * torch.randn(len(y), dim, generator=g), y)


def _rule(counts, balance):
    """The per-class counts the rule allows, computed here: each class floor or ceil of its share."""
    n = sum(counts.values())
    w = {"mean": lambda k: 1.0, "log": lambda k: math.log(k) + 1, "sqrt": math.sqrt}[balance]
    total_w = sum(w(k) for k in counts.values())
    return {c: (math.floor(n * w(k) / total_w), math.ceil(n * w(k) / total_w)) for c, k in counts.items()}


@pytest.mark.parametrize("balance", ["mean", "log", "sqrt"])
def test_class_targets_follow_the_rule_and_keep_the_epoch_length(balance):
    got = class_targets(COUNTS, balance)
    assert sum(got.values()) == 110
    for c, (lo, hi) in _rule(COUNTS, balance).items():
        assert lo <= got[c] <= hi, (c, got[c], lo, hi)
    assert class_targets(COUNTS, "y") == COUNTS
    mean, sqrt = class_targets(COUNTS, "mean"), class_targets(COUNTS, "sqrt")
    assert mean[3] > class_targets(COUNTS, "log")[3] > sqrt[3] > COUNTS[3]   # strength: mean > log > sqrt > y


@pytest.mark.parametrize("balance", ["mean", "log", "sqrt", "y"])
def test_each_epoch_draws_the_rules_counts_every_sample_as_often_as_its_classmates(balance):
    y = _imbalanced().tensors[1]
    b = ClassBalance(y, balance, seed=7)
    for epoch in range(3):
        order = b.indices(epoch)
        assert len(order) == 110
        per_class = collections.Counter(int(y[i]) for i in order)
        assert dict(per_class) == b.targets
        per_item = collections.Counter(order)
        for c, members in b.members.items():
            times = [per_item.get(int(i), 0) for i in members]
            assert max(times) - min(times) <= 1, (c, times)
    assert b.indices(1) == ClassBalance(y, balance, seed=7).indices(1)      # a function of (seed, epoch)
    if balance != "y":
        assert b.indices(1) != b.indices(2) and b.indices(1) != ClassBalance(y, balance, seed=8).indices(1)


def test_copies_of_a_sample_get_keys_of_their_own():
    y = _imbalanced().tensors[1]
    b = ClassBalance(y, "mean", seed=0)
    sampler = GlobalBatchSampler(110, 16, seed=0, resample=b)
    sampler.set_epoch(3)
    keys = [k for batch in sampler for k in batch]
    assert [i for i, _ in keys] == b.indices(3)
    assert len(set(keys)) == 110                          # no two copies seeded alike
    rare = int(b.members[3][0])                           # class 3: 5 samples drawn 27 or 28 times
    assert sorted(e for i, e in keys if i == rare)[:3] == [copy_epoch(3, 0), copy_epoch(3, 1), copy_epoch(3, 2)]


def test_the_originals_data_resample_api():
    items = [(f"img{i}.png", "cat" if i < 40 else "dog") for i in range(50)]
    r = DataResample(items, label_index=1, balance="mean", shuffle=True)
    assert r.class_count == {0: 40, 1: 10} and r.balance_nums == {0: 25, 1: 25}
    first = r.item_list
    assert len(r) == 50 and collections.Counter(label for _, label in first) == {"cat": 25, "dog": 25}
    second = r.update(shuffle=True)
    assert second != first and r.update(epoch=0) == first       # epoch 0 again: the same list
    grouped = r.update(shuffle=False, epoch=5)
    assert [label for _, label in grouped] == ["cat"] * 25 + ["dog"] * 25      # not shuffled: by class
    with pytest.raises(ValueError, match="balance"):
        DataResample(items, balance="max")


class NoLabels(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.zeros(2), i % 2


def test_labels_come_from_the_data_set_or_an_argument(tmp_path):
    from basetrainer.dataloader.image_folder import image_folder

    folder = make_image_folder(str(tmp_path / "imgs"), ["a", "b", "c"], per_class=3)
    assert labels_of(image_folder(folder)).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    data = _imbalanced()
    assert labels_of(data).tolist() == data.tensors[1].tolist()
    assert labels_of(Subset(data, [3, 1])).tolist() == data.tensors[1][[3, 1]].tolist()
    assert len(labels_of(ConcatDataset([data, data]))) == 220
    with pytest.raises(ValueError, match=r"pass labels=\[\.\.\.\] to build_dataloader"):
        build_dataloader(NoLabels(), 2, balance="mean")
    loader = build_dataloader(NoLabels(), 2, balance="mean", labels=[0, 1, 0, 1])
    assert len(loader) == 2
    with pytest.raises(ValueError, match="3 labels for a data set of 4"):
        build_dataloader(NoLabels(), 2, balance="mean", labels=[0, 1, 0])
    with pytest.raises(ValueError, match="balance='median'"):
        build_dataloader(data, 8, balance="median")
    with pytest.raises(ValueError, match="training set"):
        build_dataloader(data, 8, phase="test", balance="mean")


def test_the_balance_key_refuses_a_value_not_in_the_list():
    with pytest.raises(ValueError, match=r"'balance' = 'median' is not one of \['none', 'mean', 'log', 'sqrt'\]"):
        setup_config.validate(setup_config.Config(balance="median"))
    with pytest.raises(ValueError, match="'balance'"):
        ToyTrainer(toy_cfg(balance="oversample"))
    assert setup_config.with_defaults(setup_config.Config())["balance"] == "none"


# ----------------------------------------------------------------------------- training
class ImbalancedTrainer(ToyTrainer):
    """cfg: ``counts`` (samples per class), ``shuffle``, ``drop_last``, and the engine's keys."""

    def build_train_loader(self, cfg, **kwargs):
        counts = {int(c): n for c, n in (cfg.get("counts") or COUNTS).items()}
        return self.build_dataloader(_imbalanced(counts), cfg.batch_size, cfg.num_workers, phase="train",
                                     shuffle=cfg.get("shuffle", True), drop_last=cfg.get("drop_last", False))


class ClassCounts(Callback):
    """The labels this rank trained on, per epoch."""

    def __init__(self):
        super().__init__()
        self.labels = collections.defaultdict(list)

    def on_train_summary(self, inputs, outputs, losses, epoch, batch, logs=None):
        self.labels[epoch] += inputs[1].tolist()


def _train(rank, balance, epochs=3):
    torch.set_num_threads(1)
    counts = ClassCounts()
    t = ImbalancedTrainer(toy_cfg(num_epochs=epochs, batch_size=16, lr=0.2, momentum=0.9, balance=balance,
                                  distributed=comm.get_world_size() > 1), callbacks=[counts])
    t.run()
    per_epoch = {e: collections.Counter(sum(comm.all_gather_object(v), [])) for e, v in sorted(counts.labels.items())}
    return {"weights": {k: v.detach().clone() for k, v in t.unwrapped_model.state_dict().items()},
            "counts": per_epoch}


def test_one_process_trains_on_the_rules_counts_every_epoch():
    out = _train(0, "sqrt")
    want = class_targets(COUNTS, "sqrt")
    assert all(dict(c) == want for c in out["counts"].values()) and len(out["counts"]) == 3
    plain = _train(0, "none")
    assert all(dict(c) == COUNTS for c in plain["counts"].values())


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_balance_mean_on_2_and_3_ranks_equals_one_process(tmp_path, world):
    one = _train(0, "mean")
    many = run_distributed(_train, world, tmp_path, "mean", timeout=300)
    want = class_targets(COUNTS, "mean")
    for r in many:
        assert all(dict(c) == want for c in r["counts"].values())
        assert weight_diff(one["weights"], r["weights"]) < 1e-5


SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    from conftest import StopAt, toy_cfg
    from test_resample import ImbalancedTrainer
    from basetrainer.callbacks.callbacks import Callback
    from basetrainer.callbacks.losses_recorder import LossesRecorder
    from basetrainer.callbacks.model_checkpoint import ModelCheckpoint

    if __name__ == "__main__":
        work, resume, kill = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
        cfg = toy_cfg(num_epochs=3, batch_size=16, lr=0.2, momentum=0.9, balance="sqrt", work_dir=work,
                      resume=resume, num_workers=int(sys.argv[4]))
        callbacks = [LossesRecorder(), ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="loss", save_freq_steps=2,
                                     async_save=False)] + ([StopAt(1, 4, how=signal.SIGKILL)] if kill else [])
        t = ImbalancedTrainer(cfg, callbacks=callbacks)
        t.run()
        torch.save(t.unwrapped_model.state_dict(), os.path.join(work, "final.pt"))
""")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("workers", [0, 2])
def test_sigkill_inside_an_epoch_then_resume_auto_equals_the_uninterrupted_run(tmp_path, workers):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=os.path.join(ROOT, "tests")))

    def run(work, resume="", kill=False):
        return subprocess.run([PY, str(script), str(work), resume, "1" if kill else "0", str(workers)],
                              capture_output=True, text=True, timeout=300, cwd=str(tmp_path))

    ref = run(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = run(tmp_path / "run", kill=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    state = checkpoint.load_file(str(tmp_path / "run" / "model" / "last.pth"))
    assert (state["epoch"], state["epoch_complete"], state["batch"]) == (1, False, 4)   # inside epoch 1
    resumed = run(tmp_path / "run", resume="auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = torch.load(tmp_path / "ref" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert weight_diff(a, b) == 0.0


# ----------------------------------------------------------------------------- a changed order on resume
def _balanced_run(work, callbacks=(), **over):
    """110 samples in 7 batches of 16; last.pth after every step (and at each epoch's end)."""
    from basetrainer.callbacks.losses_recorder import LossesRecorder
    from basetrainer.callbacks.model_checkpoint import ModelCheckpoint

    counts = ClassCounts()
    cfg = toy_cfg(**{"num_epochs": 2, "batch_size": 16, "lr": 0.2, "momentum": 0.9, "work_dir": str(work), **over})
    saves = ModelCheckpoint(model_dir=os.path.join(str(work), "model"), indicator="loss", save_freq_steps=1,
                            async_save=False)
    cbs = [counts, LossesRecorder(), saves, *callbacks]
    ImbalancedTrainer(cfg, callbacks=cbs).run()
    return counts.labels


def _files(folder):
    return {p: open(os.path.join(folder, p), "rb").read() for p in sorted(os.listdir(folder))}


@pytest.mark.parametrize("before,after,named", [
    ({}, {"balance": "sqrt"}, "balance: 'none' -> 'sqrt'"),
    ({}, {"shuffle": False}, "shuffle: True -> False"),
    ({}, {"counts": {0: 70, 1: 25, 2: 10, 3: 15}}, "training samples: 110 -> 120"),
    # as many samples, other labels: the same settings draw another resampled list
    ({"balance": "sqrt"}, {"balance": "sqrt", "counts": {0: 60, 1: 35, 2: 10, 3: 5}}, "the epoch's sample order"),
])
def test_a_change_of_the_epochs_order_inside_an_epoch_is_refused_naming_it(tmp_path, before, after, named):
    # issue 31.8: SIGKILL at step 5 of 8, balance none -> sqrt: the epoch's first batches followed the
    # old order and the rest the new one (12 of 40 samples never seen that epoch), after one warning
    work = tmp_path / "run"
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        _balanced_run(work, callbacks=[StopAt(1, 3)], **before)
    state = checkpoint.load_file(str(work / "model" / "last.pth"))
    assert checkpoint.position(state) == (1, "train", 4)
    files = _files(str(work / "model"))
    with pytest.raises(ValueError) as refused:
        _balanced_run(work, resume="auto", **after)
    message = str(refused.value)
    assert named in message, message
    assert "inside epoch 1 (after step 4)" in message and "Resume with the old values to finish epoch 1" in message
    assert _files(str(work / "model")) == files           # nothing trained, nothing written
    # the same values go on, and the epoch is the uninterrupted one's
    resumed = _balanced_run(work, resume="auto", **before)
    whole = _balanced_run(tmp_path / "whole", **before)
    assert resumed[1] == whole[1][16 * 4:]


@pytest.mark.parametrize("where", ["epoch end", "last step"])
def test_a_balance_change_at_an_epoch_boundary_is_taken_by_the_next_epoch(tmp_path, where):
    # "last step": killed in epoch 0's test phase, after the checkpoint of its last step (7 of 7):
    # nothing of that epoch's order is left to train, so the change is no splice
    work = tmp_path / "run"
    if where == "epoch end":
        _balanced_run(work, num_epochs=1)
    else:
        with pytest.raises(RuntimeError, match="stopped on purpose"):
            _balanced_run(work, callbacks=[StopAt(0, event="test_begin")])
    position = checkpoint.position(checkpoint.load_file(str(work / "model" / "last.pth")))
    assert position == ((0, "end", 7) if where == "epoch end" else (0, "train", 7))
    resumed = _balanced_run(work, resume="auto", balance="sqrt")
    fresh = _balanced_run(tmp_path / "sqrt", balance="sqrt")
    assert resumed[1] == fresh[1]                          # epoch 1 in the new order, label by label
    assert dict(collections.Counter(resumed[1])) == class_targets(COUNTS, "sqrt")
    assert 0 not in resumed                                # epoch 0 was not trained again
