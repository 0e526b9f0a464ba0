"""LR schedules (basetrainer.scheduler.build_scheduler): the LR of every step, through a real
run (seen by a Recorder placed BEFORE the schedule, so the LR of step k is set before any
callback's on_batch_begin) and through ``LRSchedulerCallback.lr_at``."""
import logging
import math
import os

import pytest
import torch

from basetrainer.scheduler import build_scheduler
from basetrainer.scheduler.build_scheduler import LRSchedulerCallback
from conftest import ROOT, Recorder, TinyNet, ToyTrainer, toy_cfg

LR = 0.1
STEPS = 4  # 64 samples / batch 16


@pytest.fixture(autouse=True)
def _propagate(monkeypatch):
    """log.set_logger (called by other tests) stops propagation; caplog listens at the root."""
    monkeypatch.setattr(logging.getLogger("basetrainer"), "propagate", True)


class SchedTrainer(ToyTrainer):
    """ToyTrainer whose callbacks are [Recorder, LR schedule from cfg] (the recorder first)."""

    def build_callbacks(self, cfg, **kwargs):
        self.recorder = Recorder()
        self.sched = build_scheduler.get_scheduler(
            cfg.scheduler, optimizer=self.optimizer, lr_init=cfg.lr, num_epochs=cfg.num_epochs,
            num_steps=self.num_steps, milestones=cfg.milestones, num_warn_up=cfg.num_warn_up,
            **cfg.get("sched_kw", {}))
        return [self.recorder, self.sched]


def run_lrs(**overrides):
    cfg = toy_cfg(n_train=64, batch_size=16, lr=LR, num_epochs=3, num_warn_up=0, milestones=[100],
                  scheduler="constant")
    cfg.update(overrides)
    t = SchedTrainer(cfg)
    t.run()
    return t, t.recorder.lrs


def approx_list(values, rel=1e-6):
    return pytest.approx(values, rel=rel, abs=1e-12)


def make_sched(name="constant", num_epochs=4, num_steps=STEPS, lr=LR, **kw) -> LRSchedulerCallback:
    opt = torch.optim.SGD(TinyNet().parameters(), lr=0.5)
    return build_scheduler.get_scheduler(name, optimizer=opt, lr_init=lr, num_epochs=num_epochs,
                                         num_steps=num_steps, **kw)


# ------------------------------------------------------------------------------ warm-up + multi-step
def test_warmup_then_multistep_through_a_run():
    t, lrs = run_lrs(scheduler="multi-step", milestones=[2], num_warn_up=1)
    expected = [LR * (k + 1) / (1 * STEPS) for k in range(STEPS)] + [LR] * STEPS + [LR * 0.1] * STEPS
    assert lrs == approx_list(expected)
    assert lrs[0] == pytest.approx(0.025) and lrs[0] > 0
    warm = lrs[:STEPS + 1]
    assert all(b > a for a, b in zip(warm[:STEPS], warm[1:STEPS]))   # strictly increasing in warm-up
    assert lrs[STEPS] == pytest.approx(lrs[STEPS - 1])                # no spike at the warm-up end
    assert max(lrs) == pytest.approx(LR)
    # the recorder sits BEFORE the schedule and still saw step k's LR in on_batch_begin
    assert type(t.callbacks[0]) is Recorder and t.callbacks[1] is t.sched
    # lr_at agrees with the run
    assert [t.sched.lr_at(s)[0] for s in range(3 * STEPS)] == approx_list(lrs)


def test_fractional_warmup_per_step():
    sched = make_sched("constant", num_warn_up=0.5)   # 2 warm-up steps
    assert [sched.lr_at(s)[0] for s in range(4)] == approx_list([0.05, 0.1, 0.1, 0.1])


def test_multistep_milestones_are_zero_based_epochs():
    _, lrs = run_lrs(scheduler="multi-step", milestones=[1, 2])
    assert lrs == approx_list([LR] * STEPS + [LR * 0.1] * STEPS + [LR * 0.01] * STEPS)
    sched = make_sched("multi-step", num_epochs=10, milestones=[3, 6])
    by_epoch = [sched.lr_at(e * STEPS)[0] for e in range(10)]
    assert by_epoch == approx_list([LR] * 3 + [LR * 0.1] * 3 + [LR * 0.01] * 4)
    # unsorted milestones and a custom gamma
    sched = make_sched("multi-step", num_epochs=10, milestones=[6, 3], gamma=0.5)
    assert [sched.lr_at(e * STEPS)[0] for e in (2, 3, 6)] == approx_list([LR, LR * 0.5, LR * 0.25])


# ------------------------------------------------------------------------------ cosine
def test_cosine_through_a_run():
    t, lrs = run_lrs(scheduler="cosine", num_epochs=4)
    total = 4 * STEPS
    expected = [LR * 0.5 * (1 + math.cos(math.pi * s / total)) for s in range(total)]
    assert lrs == approx_list(expected)
    assert lrs[0] == pytest.approx(LR)
    assert lrs[total // 2] == pytest.approx(LR / 2)                  # mid-point
    assert lrs[-1] > 0 and lrs[-1] == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi * 15 / 16)))
    assert all(b <= a for a, b in zip(lrs, lrs[1:]))                  # never increases
    assert all(v >= 0 for v in lrs)


def test_cosine_with_warmup_and_lr_min():
    sched = make_sched("cosine", num_epochs=5, num_warn_up=1, lr_min=0.01)
    lrs = [sched.lr_at(s)[0] for s in range(5 * STEPS)]
    assert lrs[:STEPS] == approx_list([LR * (k + 1) / STEPS for k in range(STEPS)])
    assert lrs[STEPS] == pytest.approx(LR)                            # no spike after warm-up
    # cosine over the 4 epochs after warm-up: mid-point at epoch 3
    assert lrs[3 * STEPS] == pytest.approx(0.01 + (LR - 0.01) * 0.5)
    assert all(v > 0.01 for v in lrs[STEPS:]) and all(b <= a for a, b in zip(lrs[STEPS:], lrs[STEPS + 1:]))
    # beyond the last epoch the LR stays at lr_min, never negative
    assert sched.lr_at(10 * STEPS)[0] == pytest.approx(0.01)
    assert min(make_sched("cosine", num_epochs=2).lr_at(s)[0] for s in range(40)) >= 0


# ------------------------------------------------------------------------------ step / exp / constant
def test_step_schedule():
    _, lrs = run_lrs(scheduler="step", sched_kw={"step_size": 2})
    assert lrs == approx_list([LR] * (2 * STEPS) + [LR * 0.1] * STEPS)
    sched = make_sched("step", num_epochs=9)  # default step_size = num_epochs // 3 = 3
    assert [sched.lr_at(e * STEPS)[0] for e in (0, 2, 3, 5, 6, 8)] == approx_list(
        [LR, LR, LR * 0.1, LR * 0.1, LR * 0.01, LR * 0.01])


def test_exponential_schedule():
    _, lrs = run_lrs(scheduler="exponential")
    assert lrs == approx_list([LR * 0.95 ** (s // STEPS) for s in range(3 * STEPS)])
    sched = make_sched("exponential", gamma=0.5)
    assert sched.lr_at(3 * STEPS + 1)[0] == pytest.approx(LR * 0.125)


def test_constant_schedule():
    t, lrs = run_lrs(scheduler="constant")
    assert lrs == [LR] * (3 * STEPS)
    assert t.optimizer.param_groups[0]["lr"] == LR


# ------------------------------------------------------------------------------ names
@pytest.mark.parametrize("name,canonical", [
    ("multi-step", "multi-step"), ("Multi-Step", "multi-step"), ("MULTISTEP", "multi-step"),
    ("multi_step", "multi-step"), ("MultiStepLR", "multi-step"), ("COSINE", "cosine"), ("Cos", "cosine"),
    ("CosineAnnealingLR", "cosine"), ("Step", "step"), ("StepLR", "step"), ("Exponential", "exponential"),
    ("exp", "exponential"), ("Constant", "constant"), (" constant ", "constant"), ("none", "constant"),
])
def test_scheduler_names_case_insensitive(name, canonical):
    assert make_sched(name, milestones=[1]).name == canonical


@pytest.mark.parametrize("bad", ["poly", "", None])
def test_unknown_scheduler_lists_names(bad):
    with pytest.raises(ValueError) as info:
        make_sched(bad)
    msg = str(info.value)
    assert repr(bad) in msg
    assert "['constant', 'cosine', 'exponential', 'multi-step', 'step']" in msg


# ------------------------------------------------------------------------------ warnings, errors
def test_milestones_beyond_num_epochs_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="basetrainer"):
        make_sched("multi-step", num_epochs=5, milestones=[2, 5, 9])
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1
    assert "[5, 9]" in msgs[0] and "num_epochs=5" in msgs[0] and "0-based" in msgs[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="basetrainer"):
        make_sched("multi-step", num_epochs=5, milestones=[4])
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_negative_or_fractional_milestones_are_refused():
    """``--milestones -1`` was taken silently and trained the whole run at lr/10 (a negative
    milestone counts as passed from the start: hostile pass)."""
    from basetrainer.runtime.errors import ConfigError
    from basetrainer.utils import setup_config

    rule = "must be 0-based epochs, integers >= 0"
    with pytest.raises(ConfigError, match=r"^config key 'milestones' = \[-1\] " + rule):
        setup_config.validate(setup_config.Config(milestones=[-1]))
    for bad in ([-1], [2, -3], [1.5], [True]):
        with pytest.raises(ConfigError) as info:
            make_sched("multi-step", milestones=bad)
        assert str(info.value).startswith(f"milestones={bad!r} {rule}") and "remove it" in str(info.value)
    assert make_sched("multi-step", milestones=[0, 2]).lr_at(0)[0] == pytest.approx(LR * 0.1)   # 0 is fine


def test_warmup_covering_all_epochs_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="basetrainer"):
        make_sched("constant", num_epochs=2, num_warn_up=2)
    assert any("num_warn_up=2" in r.getMessage() and "num_epochs=2" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kwargs,words", [
    ({"num_epochs": 0}, "num_epochs=0 must be a positive integer"),
    ({"num_steps": 0}, "num_steps=0 must be the number of train batches per epoch"),
    ({"num_warn_up": -1}, "num_warn_up=-1"),
    ({"lr": -0.1}, "lr_init=-0.1 must be a finite number >= 0"),
    ({"lr": -1}, "lr_init=-1 must be a finite number >= 0"),
    ({"lr": float("nan")}, "lr_init=nan must be a finite number >= 0"),
    ({"lr": float("inf")}, "lr_init=inf must be a finite number >= 0"),
    ({"name": "step", "step_size": 0}, "step_size=0 must be a positive integer"),
    ({"name": "cosine", "lr_min": 0.2}, "lr_min=0.2 must be >= 0 and below lr=0.1"),
    ({"name": "cosine", "lr_min": float("nan")}, "lr_min=nan must be a finite number >= 0"),
    ({"name": "cosine", "lr": 0, "lr_min": 0.01}, "lr_min=0.01 must be 0 when the lr is 0"),
])
def test_bad_numbers_raise(kwargs, words):
    with pytest.raises(ValueError) as info:
        make_sched(**kwargs)
    assert words in str(info.value)


def test_lr_0_is_allowed_and_keeps_every_step_at_0():
    for name, kw in [("constant", {}), ("cosine", {"lr_min": 0.0}), ("multi-step", {"milestones": [1]})]:
        sched = make_sched(name, lr=0, num_warn_up=1, **kw)
        assert [sched.lr_at(s)[0] for s in range(4 * STEPS)] == [0.0] * (4 * STEPS), name
    t, lrs = run_lrs(lr=0, scheduler="cosine", num_warn_up=1)
    assert lrs == [0.0] * (3 * STEPS)


# ------------------------------------------------------------------------------ parameter groups
def two_group_optimizer(head_lr=None):
    """SGD with default lr 0.1: the backbone group has its own lr 0.01, the head the default."""
    net = TinyNet()
    head = {"params": list(net.net[2].parameters())}
    if head_lr is not None:
        head["lr"] = head_lr
    return torch.optim.SGD([{"params": list(net.net[0].parameters()), "lr": 0.01}, head], lr=0.1)


def test_lr_init_replaces_the_default_lr_and_groups_keep_their_own():
    opt = two_group_optimizer()
    sched = build_scheduler.get_scheduler("multi-step", opt, lr_init=0.1, num_epochs=4, num_steps=STEPS,
                                          milestones=[2])
    assert [g["lr"] for g in opt.param_groups] == approx_list([0.01, 0.1])
    assert sched.lr_at(0) == approx_list([0.01, 0.1])
    assert sched.lr_at(2 * STEPS) == approx_list([0.001, 0.01])       # each group's own LR x 0.1
    # lr_init other than the optimizer's default: only the groups at the default take it
    opt = two_group_optimizer()
    sched = build_scheduler.get_scheduler("constant", opt, lr_init=0.5, num_epochs=2, num_steps=STEPS,
                                          num_warn_up=1)
    assert sched.lr_at(0) == approx_list([0.01 / STEPS, 0.5 / STEPS])  # warm-up scales both
    sched.on_batch_prepare(1, 0, {})
    assert [g["lr"] for g in opt.param_groups] == approx_list([0.01, 0.5])


def test_per_group_lrs_through_a_run():
    class GroupTrainer(SchedTrainer):
        def build_optimizer(self, cfg, **kwargs):
            net = self.model
            return torch.optim.SGD([{"params": list(net.net[0].parameters()), "lr": 0.01},
                                    {"params": list(net.net[2].parameters())}], lr=0.1)

    cfg = toy_cfg(n_train=64, batch_size=16, lr=0.1, num_epochs=3, num_warn_up=0, milestones=[1],
                  scheduler="multi-step")
    t = GroupTrainer(cfg)
    t.run()
    assert t.recorder.lrs == approx_list([0.01] * STEPS + [0.001] * (2 * STEPS))  # group 0: its own
    assert t.optimizer.param_groups[1]["lr"] == pytest.approx(0.01)
    assert t.history["lr"] == approx_list([0.1, 0.01, 0.01])  # logs["lr"]: the config's lr, scheduled
    assert t.sched.state_dict()["base_lrs"] == approx_list([0.01, 0.1])


def test_cosine_lr_min_is_the_default_groups_end_and_a_fraction_for_the_others():
    opt = two_group_optimizer()
    sched = build_scheduler.get_scheduler("cosine", opt, lr_init=0.1, num_epochs=2, num_steps=STEPS,
                                          lr_min=0.02)
    assert sched.lr_at(2 * STEPS) == approx_list([0.002, 0.02])


# ------------------------------------------------------------------------------ logs, state
def test_logs_lr_is_written_each_epoch():
    t, lrs = run_lrs(scheduler="multi-step", milestones=[1], num_warn_up=0.5)
    logs = t.recorder.epoch_logs
    assert [row["lr"] for row in logs] == approx_list([lrs[STEPS - 1], lrs[2 * STEPS - 1], lrs[3 * STEPS - 1]])
    assert [row["lr"] for row in logs] == approx_list([LR, LR * 0.1, LR * 0.1])
    assert t.history["lr"] == approx_list([LR, LR * 0.1, LR * 0.1])


def test_state_dict_round_trip():
    t, lrs = run_lrs(scheduler="cosine", num_warn_up=1)
    state = t.sched.state_dict()
    assert state == {"last_step": 3 * STEPS - 1, "base_lrs": [LR], "origin": 0, "num_epochs": 3}
    fresh = make_sched("cosine", num_epochs=3, num_warn_up=1, lr=LR)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert [fresh.lr_at(s)[0] for s in range(3 * STEPS)] == approx_list(lrs)
    # a schedule built for another lr keeps it: a changed lr takes effect on resume
    other = make_sched("cosine", num_epochs=3, num_warn_up=1, lr=0.3)
    other.load_state_dict(state)
    assert other.state_dict() == {"last_step": 3 * STEPS - 1, "base_lrs": [0.3], "origin": 0, "num_epochs": 3}
    assert [other.lr_at(s)[0] for s in range(3 * STEPS)] == approx_list([lr * 3 for lr in lrs])


def test_resumed_run_sees_the_same_lrs():
    kw = dict(scheduler="multi-step", milestones=[2], num_warn_up=1)
    _, full = run_lrs(**kw)
    cfg = toy_cfg(n_train=64, batch_size=16, lr=LR, num_epochs=3, **kw)
    first = SchedTrainer(cfg)
    first.num_epochs = 1                                   # stop after epoch 0
    first.run()
    state = first.state_dict()
    resumed = SchedTrainer(toy_cfg(n_train=64, batch_size=16, lr=LR, num_epochs=3, **kw))
    resumed.load_state_dict(state)
    assert resumed.start_epoch == 1 and resumed.global_step == STEPS
    resumed.run()
    assert first.recorder.lrs == approx_list(full[:STEPS])
    assert resumed.recorder.lrs == approx_list(full[STEPS:])


# ------------------------------------------------------------------------------ num_epochs changed on resume
class CheckpointedSchedTrainer(SchedTrainer):
    """SchedTrainer with a loss and a ModelCheckpoint in work_dir (so resume: auto continues it)."""

    def build_callbacks(self, cfg, **kwargs):
        from basetrainer.callbacks.losses_recorder import LossesRecorder
        from basetrainer.callbacks.model_checkpoint import ModelCheckpoint

        return super().build_callbacks(cfg, **kwargs) + [
            LossesRecorder(), ModelCheckpoint(model_dir=os.path.join(cfg.work_dir, "model"), indicator="loss",
                                              async_save=False)]


def _cosine(step, steps, lr=LR):
    return lr * 0.5 * (1 + math.cos(math.pi * step / steps))


@pytest.mark.parametrize("policy", ["stretch", "restart"])
def test_raising_num_epochs_on_resume_stretches_or_restarts_the_schedule(tmp_path, caplog, policy):
    # a cosine run of 2 epochs (8 steps) that finished, resumed with num_epochs 4 (steps 8..15)
    kw = dict(n_train=64, batch_size=16, lr=LR, scheduler="cosine", num_warn_up=0, milestones=[100],
              work_dir=str(tmp_path / "work"))
    first = CheckpointedSchedTrainer(toy_cfg(num_epochs=2, **kw))
    first.run()
    assert first.recorder.lrs == approx_list([_cosine(s, 8) for s in range(8)])   # ends at 0.0038
    with caplog.at_level(logging.INFO, logger="basetrainer"):
        resumed = CheckpointedSchedTrainer(toy_cfg(num_epochs=4, resume="auto", schedule_on_resume=policy, **kw))
        resumed.run()
    lrs = resumed.recorder.lrs
    if policy == "stretch":   # the 16-step cosine from step 8 on: half the LR, then down to 0
        assert lrs == approx_list([_cosine(s, 16) for s in range(8, 16)])
        assert lrs[0] == pytest.approx(0.05) and lrs[4] == pytest.approx(0.0146447, rel=1e-5)
    else:                     # a new 8-step cosine from step 8: the whole LR again
        assert lrs == approx_list([_cosine(s - 8, 8) for s in range(8, 16)])
        assert lrs[0] == pytest.approx(LR) and lrs[4] == pytest.approx(0.05)
    said = [r.getMessage() for r in caplog.records if "on resume: the cosine LR schedule" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith(f"num_epochs 2 -> 4 on resume: the cosine LR schedule ")
    assert f"(schedule_on_resume: {policy}" in said[0]
    assert f"the LR goes from 0.00381 (step 7) to {lrs[0]:.3g} (step 8)" in said[0]
    # the restart is kept by a later resume (same num_epochs: nothing changes, nothing said)
    state = torch.load(os.path.join(kw["work_dir"], "model", "last.pth"), weights_only=True)
    sched = next(v for k, v in state["callbacks"].items() if k.startswith("LRSchedulerCallback"))
    assert sched["origin"] == (8 if policy == "restart" else 0) and sched["num_epochs"] == 4


def test_schedule_on_resume_takes_stretch_or_restart_only():
    from basetrainer.runtime.errors import ConfigError
    from basetrainer.utils import setup_config

    with pytest.raises(ConfigError, match=r"'schedule_on_resume' = 'again' is not one of \['stretch', 'restart'\]"):
        setup_config.validate(setup_config.Config(schedule_on_resume="again"))
    with pytest.raises(ConfigError, match=r"on_resume='again' must be one of \['stretch', 'restart'\]"):
        make_sched("cosine", on_resume="again")


# ------------------------------------------------------------------------------ accumulation
def test_gradient_accumulation_counts_optimizer_steps():
    t, lrs = run_lrs(scheduler="multi-step", milestones=[2], num_warn_up=1, accumulate_steps=2)
    assert t.accumulate_steps == 2 and t.sched.steps_per_epoch() == 2
    assert t.global_step == 3 * 2
    # warm-up over 2 optimizer steps: micro-batches 0,1 -> step 0, 2,3 -> step 1
    assert lrs == approx_list([0.05, 0.05, 0.1, 0.1] + [LR] * 4 + [LR * 0.1] * 4)
    assert [t.sched.lr_at(s)[0] for s in range(6)] == approx_list([0.05, 0.1, LR, LR, 0.01, 0.01])


def test_gradient_accumulation_uneven_epoch_rounds_up():
    # 5 micro-batches per epoch, 2 per step -> 3 optimizer steps (the last one alone)
    t, lrs = run_lrs(n_train=80, scheduler="constant", num_warn_up=1, accumulate_steps=2, num_epochs=2)
    assert t.num_steps == 5 and t.sched.steps_per_epoch() == 3 and t.global_step == 6
    assert lrs == approx_list([LR / 3, LR / 3, 2 * LR / 3, 2 * LR / 3, LR] + [LR] * 5)


def test_num_steps_is_the_train_batches_of_an_epoch_as_the_trainer_page_says():
    # issue 31 (minor): docs/trainer.md called num_steps "optimizer steps per epoch"; on 8 batches
    # with accumulate_steps: 3 it is 8, the optimizer steps 3 times and the schedule counts 3
    t, lrs = run_lrs(n_train=128, num_epochs=1, num_warn_up=1, accumulate_steps=3)
    assert t.num_steps == 8 == len(t.train_loader)
    assert t.sched.steps_per_epoch() == 3 and t.global_step == 3
    assert lrs == approx_list([LR / 3] * 3 + [2 * LR / 3] * 3 + [LR] * 2)   # warm-up over the 3 steps
    page = " ".join(open(os.path.join(ROOT, "docs", "trainer.md")).read().split())
    assert ("`num_steps` (train batches per epoch, `len(train_loader)`: with `accumulate_steps: 3` on 8 batches it "
            "is 8, and the optimizer steps 3 times an epoch") in page
