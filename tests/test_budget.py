"""The hot path's budget, in counts (tests/hot_path.py): what one training step of the tiny CNN
does beyond a hand-written PyTorch step, with callbacks off and with examples/example.py's
callbacks, and what the default loader does beyond a plain DataLoader, per item and per batch.

Counts, not times: they do not move with the machine's load, so a change that adds work to
every step fails here, naming the count that grew. Each budget is today's count; the margin is
none for ops, host syncs and Python calls (one more of them per step is what this must catch)
and BYTES_MARGIN for tensor bytes. A change that makes a step cheaper passes; lower the budget
with it.
"""
import logging
import os
from typing import Any, Dict, List

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hot_path
from basetrainer.callbacks import log_history, losses_recorder, model_checkpoint
from basetrainer.criterion.criterion import get_criterion
from basetrainer.dataloader.loader import build_dataloader
from basetrainer.engine import trainer
from basetrainer.metric import accuracy_recorder
from basetrainer.optimizer.build_optimizer import get_optimizer
from basetrainer.scheduler import build_scheduler

BATCH, STEPS, EPOCHS, LOG_FREQ = 64, 12, 2, 4
QUIET = (1, 2, 5, 6, 9)     # steps of an epoch that do not log (log_freq 4: steps 3, 7 and 11 log)
LOGGING = (7,)              # (not 3: the first log of an epoch starts its figures; not 11: the last step)
BYTES_MARGIN = 64           # bytes per step: a scalar tensor or two

# today's counts beyond the hand loop's (ops, bytes) or in all (syncs, calls), per step; refresh
# them with `python tests/test_budget.py` when a change makes a step cheaper
BUDGET: Dict[str, Dict[str, int]] = {
    "callbacks off": {"ops": 1, "syncs": 0, "calls": 24, "bytes": 0},
    "callbacks off, logging step": {"ops": 12, "syncs": 1, "calls": 26, "bytes": 45},
    "example's callbacks": {"ops": 6, "syncs": 0, "calls": 50, "bytes": 512},
    "example's callbacks, logging step": {"ops": 42, "syncs": 6, "calls": 78, "bytes": 11253},
}
# the default loader (per-sample seeding) beyond a plain DataLoader of the same TensorDataset
LOADER_BUDGET: Dict[str, Dict[str, int]] = {
    "per item": {"ops": 0, "syncs": 0, "calls": 0, "bytes": 0},
    "per batch": {"ops": 0, "syncs": 0, "calls": 5, "bytes": 0},
}


class TinyCNN(nn.Module):
    """bench/loop_contenders.py's tiny CNN (3x8x8 inputs, 10 classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True),
                                      nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def dataset(n: int = BATCH * STEPS) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


class BudgetTrainer(trainer.EngineTrainer):
    """A new user's trainer: the default loader, get_criterion, get_optimizer; with
    examples/example.py's callbacks (its config's scheduler, cosine with a warm-up epoch, and
    loggers, tensorboard and csv) or none."""

    def __init__(self, cfg: Any, callbacks: bool) -> None:
        super().__init__(cfg)
        self.with_callbacks = callbacks
        self.build(self.cfg)

    def build_train_loader(self, cfg: Any, **kwargs: Any) -> DataLoader:
        return self.build_dataloader(dataset(), cfg.batch_size, cfg.num_workers, phase="train")

    def build_test_loader(self, cfg: Any, **kwargs: Any) -> None:
        return None

    def build_model(self, cfg: Any, **kwargs: Any) -> nn.Module:
        torch.manual_seed(0)
        return self.build_model_parallel(TinyCNN(), cfg.gpu_id, distributed=cfg.distributed)

    def build_criterion(self, cfg: Any, **kwargs: Any) -> nn.Module:
        return get_criterion("CrossEntropyLoss", 10, device=self.device)

    def build_optimizer(self, cfg: Any, **kwargs: Any) -> torch.optim.Optimizer:
        return get_optimizer(self.model, "SGD", lr=0.05, momentum=0.9, weight_decay=5e-4)

    def build_callbacks(self, cfg: Any, **kwargs: Any) -> List[Any]:
        if not self.with_callbacks:
            return []
        logger = logging.getLogger("test_budget")
        return [
            accuracy_recorder.AccuracyRecorder(target_names=[str(i) for i in range(10)], indicator="Accuracy",
                                               logger=logger),
            losses_recorder.LossesRecorder(indicator="loss"),
            build_scheduler.get_scheduler("cosine", optimizer=self.optimizer, lr_init=0.05, num_epochs=cfg.num_epochs,
                                          num_steps=self.num_steps, milestones=[1], num_warn_up=1),
            log_history.LogHistory(log_dir=os.path.join(cfg.work_dir, "log"), log_freq=cfg.log_freq, logger=logger,
                                   indicators=["loss", "Accuracy"], is_main_process=self.is_main_process,
                                   loggers=["tensorboard", "csv"]),
            model_checkpoint.ModelCheckpoint(model=self.model, optimizer=self.optimizer,
                                             model_dir=os.path.join(cfg.work_dir, "model"), epochs=cfg.num_epochs,
                                             start_save=0, indicator="Accuracy", logger=logger),
        ]


def basetrainer_steps(work_dir: str, callbacks: bool) -> List[hot_path.Counts]:
    cfg = {"batch_size": BATCH, "num_epochs": EPOCHS, "gpu_id": [], "progress": False, "log_freq": LOG_FREQ,
           "work_dir": work_dir, "seed": 2020, "num_workers": 0}
    t = BudgetTrainer(cfg, callbacks)
    with hot_path.counting() as counter:
        hot_path.counted_loader(t.train_loader, counter)
        t.run()
    assert len(counter.windows) == STEPS * EPOCHS
    return counter.windows


def hand_steps() -> List[hot_path.Counts]:
    torch.manual_seed(0)
    model = TinyCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    criterion = nn.CrossEntropyLoss()
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=2020)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    with hot_path.counting() as counter:
        hot_path.counted_loader(loader, counter)
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            for x, y in loader:
                loss = criterion(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return counter.windows


@pytest.fixture(scope="module")
def hand() -> List[hot_path.Counts]:
    return hand_steps()


def beyond(b: hot_path.Counts, h: hot_path.Counts) -> Dict[str, Any]:
    """The four counts of a basetrainer step: ops and bytes beyond the hand step's."""
    return {"ops": sum(b.ops.values()) - sum(h.ops.values()), "syncs": sum(b.syncs.values()),
            "calls": sum(b.calls.values()), "bytes": b.bytes - h.bytes}


def check(name: str, got: Dict[str, int], budget: Dict[str, int], b: hot_path.Counts, h: hot_path.Counts) -> None:
    """Every count within its budget, or a failure naming each count that grew, and by what."""
    over = []
    for key, limit in budget.items():
        allowed = limit + (BYTES_MARGIN if key == "bytes" else 0)
        if got[key] > allowed:
            detail = {"ops": lambda: hot_path.difference(b.ops, h.ops), "syncs": lambda: dict(b.syncs),
                      "calls": lambda: dict(b.calls), "bytes": lambda: f"{b.bytes} B vs the hand loop's {h.bytes} B"}
            over.append(f"{key}: {got[key]} > budget {allowed} ({detail[key]()})")
    assert not over, f"{name}: the hot path grew: " + "; ".join(over)


@pytest.mark.slow   # 2 epochs of 12 steps under a dispatch mode and a profile hook: 10-30 s
@pytest.mark.parametrize("callbacks", [False, True], ids=["callbacks off", "example's callbacks"])
def test_a_training_step_stays_within_its_budget(tmp_path, hand, callbacks):
    steps = basetrainer_steps(str(tmp_path), callbacks)
    name = "example's callbacks" if callbacks else "callbacks off"
    for kind, which in ((name, QUIET), (f"{name}, logging step", LOGGING)):
        counted = [(STEPS + s, beyond(steps[STEPS + s], hand[STEPS + s])) for s in which]   # the second epoch
        first_step, first = counted[0]
        # the same work every such step (else a count here would be luck)
        assert all(c == first for _, c in counted), f"{kind}: steps differ: {counted}"
        check(kind, first, BUDGET[kind], steps[first_step], hand[first_step])
    quiet = [steps[STEPS + s] for s in QUIET]
    assert all(sum(s.syncs.values()) == 0 for s in quiet), "a step that does not log read a tensor's value"


def loader_batches(loader: DataLoader, batches: int) -> List[hot_path.Counts]:
    """Counts of fetching each of the first ``batches`` batches of ``loader``."""
    with hot_path.counting() as counter:
        it = iter(loader)
        for _ in range(batches):
            counter.start()
            next(it)
            counter.stop()
    return counter.windows


def loader_counts(batch_size: int) -> Dict[str, hot_path.Counts]:
    data = dataset(BATCH * STEPS)
    default = build_dataloader(data, batch_size, 0, phase="train", seed=2020)
    plain = DataLoader(data, batch_size=batch_size,
                       sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=2020))
    # the second batch: the first one also starts the iterator's sampler
    return {"default": loader_batches(default, 2)[1], "plain": loader_batches(plain, 2)[1]}


def test_the_default_loader_stays_within_its_budget_per_item_and_per_batch():
    small, large = loader_counts(16), loader_counts(32)
    per = {}
    for size, counts in ((16, small), (32, large)):
        per[size] = beyond(counts["default"], counts["plain"])
    per_item = {k: (per[32][k] - per[16][k]) // 16 for k in per[16]}
    per_batch = {k: per[16][k] - 16 * per_item[k] for k in per[16]}
    assert all((per[32][k] - per[16][k]) % 16 == 0 for k in per[16]), per     # exactly linear in the items
    check("default loader, per item", per_item, LOADER_BUDGET["per item"], large["default"], large["plain"])
    check("default loader, per batch", per_batch, LOADER_BUDGET["per batch"], small["default"], small["plain"])


def measure() -> Dict[str, Dict[str, int]]:
    """Today's counts, as BUDGET and LOADER_BUDGET hold them (``python tests/test_budget.py``)."""
    import tempfile

    hand, out = hand_steps(), {}
    for callbacks, name in ((False, "callbacks off"), (True, "example's callbacks")):
        with tempfile.TemporaryDirectory() as work_dir:
            steps = basetrainer_steps(work_dir, callbacks)
        out[name] = beyond(steps[STEPS + QUIET[0]], hand[STEPS + QUIET[0]])
        out[f"{name}, logging step"] = beyond(steps[STEPS + LOGGING[0]], hand[STEPS + LOGGING[0]])
    small, large = loader_counts(16), loader_counts(32)
    per = {size: beyond(c["default"], c["plain"]) for size, c in ((16, small), (32, large))}
    out["loader per item"] = {k: (per[32][k] - per[16][k]) // 16 for k in per[16]}
    out["loader per batch"] = {k: per[16][k] - 16 * out["loader per item"][k] for k in per[16]}
    return out


if __name__ == "__main__":
    for key, value in measure().items():
        print(f"{key}: {value}")
