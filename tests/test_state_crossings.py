"""The run's state where callbacks meet the checkpoint (found by the hostile pass of 2026-11-28):
a step checkpoint holds every callback's state of that step, state keys that would clash or fail
are refused before training, a background write copies a callback's set, and a callback's
restore runs bound to the trainer and is named when it fails."""
import os

import pytest
import torch

from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.runtime import atomic
from conftest import StopAt, ToyTrainer, toy_cfg


class Counter(Callback):
    """Counts train steps; its state is the count (and, if given, ``extra``)."""

    def __init__(self, key=None, extra=None):
        super().__init__()
        self.key, self.n, self.extra = key, 0, extra

    @property
    def state_key(self):
        return self.key or "Counter"

    def on_batch_end(self, batch, logs=None):
        self.n += 1

    def state_dict(self):
        return {"n": self.n, **({"extra": self.extra} if self.extra is not None else {})}

    def load_state_dict(self, state):
        self.n = state["n"]


def _cfg(tmp_path, **kw):
    return toy_cfg(**{**dict(work_dir=str(tmp_path / "run"), n_train=128, batch_size=16, num_epochs=2), **kw})


def _last(tmp_path):
    return torch.load(os.path.join(tmp_path, "run", "model", "last.pth"), weights_only=True)


def test_a_step_checkpoint_holds_the_state_of_the_callbacks_after_model_checkpoint(tmp_path):
    counter = Counter()
    checkpoint = ModelCheckpoint(model_dir=str(tmp_path / "run" / "model"), save_freq_steps=3, async_save=False)
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        ToyTrainer(_cfg(tmp_path), callbacks=[checkpoint, counter, StopAt(0, 4)]).run()
    state = _last(tmp_path)
    assert (state["epoch"], state["batch"]) == (0, 3)
    assert state["callbacks"]["Counter"] == {"n": 3}   # was 2: saved before the callbacks after it counted step 3


def test_a_state_key_clashing_with_a_numbered_one_is_refused_before_training(tmp_path):
    trainer = ToyTrainer(_cfg(tmp_path), callbacks=[Counter(), Counter(), Counter("Counter#2")])
    with pytest.raises(ValueError, match=r"callbacks Counter and Counter both keep their state under 'Counter#2' .* "
                                         r"give one of them another state_key"):
        trainer.run()
    assert trainer.global_step == 0


def test_a_failing_state_key_is_found_before_training_and_named(tmp_path):
    class NoKey(Callback):
        @property
        def state_key(self):
            raise AttributeError("no key yet")

    trainer = ToyTrainer(_cfg(tmp_path), callbacks=[NoKey()])
    with pytest.raises(AttributeError, match="no key yet") as info:
        trainer.run()
    assert trainer.global_step == 0
    assert "raised reading callback NoKey.state_key (its state's name in the checkpoint)" in info.value.__notes__


def test_a_background_write_copies_a_callbacks_set():
    live = {"seen": {1, 2, 3}, "nested": [{4, 5}]}
    copy = atomic.snapshot(live)
    live["seen"].add(99)
    live["nested"][0].clear()
    assert copy == {"seen": {1, 2, 3}, "nested": [{4, 5}]}


def test_a_callback_is_restored_bound_to_the_trainer_and_named_when_its_restore_fails(tmp_path):
    ToyTrainer(_cfg(tmp_path), callbacks=[ModelCheckpoint(model_dir=str(tmp_path / "run" / "model")),
                                          Counter(extra=(1, 2))]).run()

    class OnDevice(Counter):
        def load_state_dict(self, state):
            self.n = torch.tensor(state["n"], device=self.trainer.device)   # the trainer is there

    resumed = OnDevice()
    trainer = ToyTrainer(_cfg(tmp_path, resume="auto", num_epochs=3), callbacks=[
        ModelCheckpoint(model_dir=str(tmp_path / "run" / "model")), resumed])
    trainer.run()
    assert int(resumed.n) == 3 * 8

    class Broken(Counter):
        def load_state_dict(self, state):
            raise KeyError("oops")

    trainer = ToyTrainer(_cfg(tmp_path, resume="auto", num_epochs=4), callbacks=[
        ModelCheckpoint(model_dir=str(tmp_path / "run" / "model")), Broken()])
    with pytest.raises(KeyError, match="oops") as info:
        trainer.run()
    assert any(note.startswith("raised in callback Broken.load_state_dict, restoring its state 'Counter' from ")
               for note in info.value.__notes__), info.value.__notes__


def test_a_state_with_a_tuple_key_is_saved_and_restored(tmp_path):
    counter = Counter(extra={(1, 2): 3})
    ToyTrainer(_cfg(tmp_path), callbacks=[ModelCheckpoint(model_dir=str(tmp_path / "run" / "model")), counter]).run()
    assert _last(tmp_path)["callbacks"]["Counter"] == {"n": 16, "extra": {(1, 2): 3}}


def test_removing_one_of_two_callbacks_keyed_by_order_is_named_on_resume(tmp_path, caplog):
    model_dir = str(tmp_path / "run" / "model")
    ToyTrainer(_cfg(tmp_path), callbacks=[ModelCheckpoint(model_dir=model_dir), Counter(), Counter()]).run()
    with caplog.at_level("WARNING"):
        ToyTrainer(_cfg(tmp_path, resume="auto", num_epochs=3), callbacks=[ModelCheckpoint(model_dir=model_dir),
                                                                           Counter()]).run()
    assert "2 callbacks kept state under 'Counter' (numbered by their order: 'Counter', 'Counter#2', ...) and 1 do " \
           "now: each takes the state saved at its place, which may be another one's; give each a state_key of its " \
           "own" in caplog.text


def test_save_checkpoint_called_from_on_batch_end_waits_for_the_callbacks_after_it(tmp_path):
    class SaveEvery3(Callback):
        def on_batch_end(self, batch, logs=None):
            if (batch + 1) % 3 == 0:
                self.trainer.save_checkpoint()

    with pytest.raises(RuntimeError, match="stopped on purpose"):
        ToyTrainer(_cfg(tmp_path), callbacks=[ModelCheckpoint(model_dir=str(tmp_path / "run" / "model")),
                                              SaveEvery3(), Counter(), StopAt(0, 4)]).run()
    state = _last(tmp_path)
    assert (state["batch"], state["callbacks"]["Counter"]) == (3, {"n": 3})


def test_keys_the_user_chose_with_a_hash_are_not_taken_for_numbered_ones(tmp_path, caplog):
    model_dir = str(tmp_path / "run" / "model")
    ToyTrainer(_cfg(tmp_path), callbacks=[ModelCheckpoint(model_dir=model_dir), Counter("loss#train"),
                                          Counter("loss#test")]).run()
    kept = Counter("loss#test")
    with caplog.at_level("WARNING"):
        ToyTrainer(_cfg(tmp_path, resume="auto", num_epochs=3), callbacks=[ModelCheckpoint(model_dir=model_dir),
                                                                           kept]).run()
    assert kept.n == 3 * 8 and "numbered by their order" not in caplog.text
