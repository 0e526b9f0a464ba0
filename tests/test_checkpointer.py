"""The checkpointer (basetrainer/engine/checkpointer.py): one object composed into the engine holds
where the run is, its saves and the point a run starts from. A position gives one start point,
whether it comes from a loaded checkpoint or from the end of the last ``run()`` on the same
trainer; resume.py decides how a run starts and hands that over, writing none of the engine's
state itself."""
import ast
import os
import signal

import pytest
import torch

from basetrainer.callbacks.callbacks import Callback
from basetrainer.runtime import checkpoint

from conftest import ROOT, StopAt, ToyTrainer, toy_cfg

# 64 samples in batches of 16: 4 train steps an epoch, one test batch
CFG = dict(num_epochs=3, n_train=64, n_test=16, batch_size=16)


# where a SIGTERM arrives in epoch 1: after train step 1, in the test phase, or at the epoch's end
# (the engine stops there, saves, and exits with 143)
SIGTERM_IN = {"train": dict(batch=1), "test": dict(event="test"), "end": dict(event="epoch_end")}


class Seen(Callback):
    """Where a run starts: (start_epoch, batch_in_epoch) at on_train_begin, and its first step."""

    def on_train_begin(self, logs=None):
        self.start, self.first = (self.trainer.start_epoch, self.trainer.batch_in_epoch), None

    def on_train_summary(self, inputs, outputs, losses, epoch, batch, logs=None):
        self.first = self.first or ("train", epoch, batch)

    def on_test_summary(self, inputs, outputs, losses, epoch, batch, logs=None):
        self.first = self.first or ("test", epoch, batch)


@pytest.mark.slow
@pytest.mark.parametrize("where,position,start,first", [
    ("train", (1, "train", 2), (1, 2), ("train", 1, 2)),   # after step 1: the next step is 2
    ("test", (1, "test", 4), (1, 4), ("test", 1, 0)),      # the test phase is done again
    ("end", (1, "end", 4), (2, 0), ("train", 2, 0)),       # the next epoch, none of its steps done
])
def test_run_again_after_a_preemption_starts_where_its_checkpoint_does(tmp_path, where, position, start, first):
    reference = ToyTrainer(toy_cfg(**CFG))
    reference.run()
    work = tmp_path / "work"
    seen = Seen()
    stopped = ToyTrainer(toy_cfg(work_dir=str(work), **CFG), callbacks=[StopAt(1, how=signal.SIGTERM, **SIGTERM_IN[where]), seen])
    with pytest.raises(SystemExit) as leave:
        stopped.run()
    assert leave.value.code == 128 + signal.SIGTERM
    state = checkpoint.load_file(str(work / "model" / "last.pth"))
    assert checkpoint.position(state) == position

    stopped.run()                        # run() again on the same trainer: on from where it stopped
    loaded_seen = Seen()
    loaded = ToyTrainer(toy_cfg(**CFG), callbacks=[loaded_seen])
    loaded.load_state_dict(state, source=str(work / "model" / "last.pth"))
    loaded.run()                         # a new trainer from the checkpoint of that point

    assert (seen.start, seen.first) == (loaded_seen.start, loaded_seen.first) == (start, first)
    want = reference.unwrapped_model.state_dict()
    for trainer in (stopped, loaded):
        assert trainer.global_step == reference.global_step == 12
        got = trainer.unwrapped_model.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), f"{where}: weights differ from the uninterrupted run"


def test_resume_decides_and_writes_none_of_the_engines_state():
    """resume.py hands its decision to ``trainer.checkpointer.start``; it assigns no attribute
    of the trainer (nor of anything reached through it) itself."""
    path = os.path.join(ROOT, "basetrainer", "engine", "resume.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)

    def reaches_trainer(node):
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return isinstance(node, ast.Name) and node.id in ("trainer", "engine")

    writes = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and reaches_trainer(part):
                    writes.append(f"resume.py:{part.lineno}: {ast.unparse(part)} = ...")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and node.args and reaches_trainer(node.args[0])):
            writes.append(f"resume.py:{node.lineno}: {ast.unparse(node)}")
    assert not writes, "\n".join(writes)


def test_the_engine_has_a_checkpointer_and_is_not_one():
    from basetrainer.engine import checkpointer, engine

    t = ToyTrainer(toy_cfg(**CFG))
    assert isinstance(t.checkpointer, checkpointer.Checkpointer) and t.checkpointer.engine is t
    assert engine.Engine.__bases__ == (object,)          # composed, not mixed in
    t.run()
    # the position the loop moved on is the checkpointer's, read and written through the engine's names
    assert (t.epoch, t.phase, t.batch_in_epoch, t.global_step) == (2, "end", 4, 12)
    assert (t.checkpointer.epoch, t.checkpointer.phase, t.checkpointer.global_step) == (2, "end", 12)
    assert t.epoch_complete
    t.start_epoch = 1
    assert t.checkpointer.start_epoch == 1


class NoisyBlobs(torch.utils.data.Dataset):
    """blobs with noise drawn from torch's global generator when an item is loaded (a random
    augmentation in the main process)."""

    def __init__(self) -> None:
        from conftest import blobs

        self.data = blobs(CFG["n_train"], 4, seed=0)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return x + 0.3 * torch.randn(x.shape), y


class PlainLoaderTrainer(ToyTrainer):
    """A train loader that cannot start late (a plain DataLoader: no ``start_at``)."""

    def build_train_loader(self, cfg, **kwargs):
        return torch.utils.data.DataLoader(NoisyBlobs(), batch_size=cfg.batch_size, shuffle=False)


def test_a_loader_that_cannot_start_late_resumes_mid_epoch_exactly(tmp_path):
    """The batches trained before the stop are drawn and dropped, and the generators are put back
    after them, so the next batch draws the noise the uninterrupted run drew."""
    reference = PlainLoaderTrainer(toy_cfg(**CFG))
    reference.run()
    work = tmp_path / "work"
    stopped = PlainLoaderTrainer(toy_cfg(work_dir=str(work), **CFG), callbacks=[StopAt(1, 1, how=signal.SIGTERM)])
    with pytest.raises(SystemExit):
        stopped.run()
    state = checkpoint.load_file(str(work / "model" / "last.pth"))
    assert checkpoint.position(state) == (1, "train", 2)
    resumed = PlainLoaderTrainer(toy_cfg(**CFG))
    resumed.load_state_dict(state)
    resumed.run()
    want, got = reference.unwrapped_model.state_dict(), resumed.unwrapped_model.state_dict()
    assert resumed.global_step == 12
    assert all(torch.equal(got[k], want[k]) for k in want), "weights differ from the uninterrupted run"
