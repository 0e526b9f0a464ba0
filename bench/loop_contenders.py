"""The two contenders of ``bench_loop.py``: basetrainer's loop and a hand-written PyTorch loop.

Both train the same model (the same initial weights, loaded from one state_dict), on the same
data set (an in-memory :class:`~torch.utils.data.TensorDataset`, or the digits ImageFolder with
examples/example.py's transforms), in the same order, with the same optimizer (SGD, momentum
0.9, weight decay 5e-4) and the same loss. basetrainer's train loader is what a user gets from
``self.build_dataloader(dataset, batch_size, num_workers, phase="train")`` with nothing else
given: per-sample seeding of random draws on, persistent workers when there are workers. The
hand loop's is a plain ``DataLoader`` with a :class:`~torch.utils.data.DistributedSampler`
seeded with the same seed (``set_epoch`` every epoch, rank-strided in DDP): the same order. Each
returns the same :class:`RunResult`, so the caller can alternate them and compare their epoch
times (wall and CPU), their per-epoch losses and their final weights (on in-memory tensors; the
digits' random augmentation draws differently by design: basetrainer seeds it per sample).

Timing: an epoch of either contender runs from just before ``sampler.set_epoch(epoch)`` to the
end of the epoch (basetrainer: the end of the last callback's ``on_epoch_end``; hand loop: the
end of its epoch, after reading its loss when it tracks one). A run's epoch time is the time
from the first epoch's start to the last epoch's end divided by the number of epochs, so the
work between epochs is counted too. Building the trainer, the model and the loaders, and
``on_train_begin``/``on_train_end``, are outside the epochs and reported apart (``outside_s``).
"""
import copy
import gc
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import loop_stats

from basetrainer.callbacks import log_history, losses_recorder, model_checkpoint
from basetrainer.callbacks.callbacks import Callback
from basetrainer.criterion.criterion import get_criterion
from basetrainer.engine import trainer
from basetrainer.metric import accuracy_recorder
from basetrainer.optimizer.build_optimizer import get_optimizer
from basetrainer.scheduler import build_scheduler

SEED = 2020
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4
NUM_CLASSES = 10


class TinyCNN(nn.Module):
    """Two 3x3 convolutions and a linear head on 3x8x8 inputs (~17k parameters).

    So little compute per sample that the loop's own cost (Python, callbacks) shows.
    """

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.head = nn.Linear(32 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class TinyCNN32(nn.Module):
    """The tiny CNN for 3x32x32 inputs (the digits at examples/example.py's input size): two
    convolutions, each followed by 2x2 pooling, then the same linear head."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(4))
        self.head = nn.Linear(32 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class MLP(nn.Module):
    """examples/regression.py's model at its defaults: 10 features, one hidden layer of 16 (tanh),
    one output."""

    def __init__(self, in_features: int = 10, hidden: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def resnet18_32() -> nn.Module:
    """basetrainer's model zoo resnet18 for 32x32 inputs and 10 classes."""
    from basetrainer.models import build_models

    return build_models.get_models("resnet18", [32, 32], NUM_CLASSES)


MODELS: Dict[str, Callable[[], nn.Module]] = {"tiny_cnn": TinyCNN, "resnet18": resnet18_32, "mlp": MLP,
                                               "tiny_cnn32": TinyCNN32}
INPUT_SHAPES = {"tiny_cnn": (3, 8, 8), "resnet18": (3, 32, 32), "mlp": (10,)}


@dataclass
class Spec:
    """What one comparison trains.

    Attributes:
        model: a key of :data:`MODELS`.
        samples: training samples per epoch (the whole data set, all processes).
        batch_size: the global batch.
        epochs: epochs per timed run.
        callbacks: basetrainer gets the default callback set (recorders, LogHistory with
            TensorBoard, ModelCheckpoint, LR schedule); otherwise none.
        lr: the learning rate (the schedule keeps it constant over the run).
        world: processes (2 = DDP over gloo).
        data: ``"tensor"`` (random inputs in memory) or ``"digits"`` (the digits ImageFolder
            with examples/example.py's training transforms; ``samples`` is then its size).
        workers: DataLoader worker processes (both contenders).
        task: ``"classify"`` (cross-entropy, 10 classes) or ``"regress"`` (MSE, one output).
    """

    model: str
    samples: int
    batch_size: int
    epochs: int
    callbacks: bool
    lr: float = 0.05
    world: int = 1
    data: str = "tensor"
    workers: int = 0
    task: str = "classify"

    def loss(self) -> nn.Module:
        return nn.MSELoss() if self.task == "regress" else nn.CrossEntropyLoss()


@dataclass
class RunResult:
    """What one training run of either contender measured.

    Attributes:
        epoch_s: wall time of each epoch.
        run_epoch_s: (last epoch's end - first epoch's start) / epochs.
        cpu_epoch_s: the same span in CPU time (the process's threads, and its workers).
        losses: the sample-weighted mean train loss of each epoch (empty when not tracked).
        outside_s: wall time of the run outside its epochs (setup and teardown events).
        weights: the final weights (unwrapped state_dict, on the CPU).
    """

    epoch_s: List[float] = field(default_factory=list)
    run_epoch_s: float = 0.0
    cpu_epoch_s: float = 0.0
    losses: List[float] = field(default_factory=list)
    outside_s: float = 0.0
    weights: Optional[Dict[str, torch.Tensor]] = None


def make_dataset(spec: Spec) -> Dataset:
    """Random inputs whose labels (or targets) a fixed random linear map decides (a learnable
    task), or the digits ImageFolder."""
    if spec.data == "digits":
        import loop_probes

        return loop_probes.example_dataset([32, 32])
    g = torch.Generator().manual_seed(SEED)
    shape = INPUT_SHAPES[spec.model]
    x = torch.randn(spec.samples, *shape, generator=g)
    if spec.task == "regress":
        w = torch.randn(x[0].numel(), 1, generator=g)
        return TensorDataset(x, x.flatten(1) @ w + 0.1 * torch.randn(spec.samples, 1, generator=g))
    w = torch.randn(x[0].numel(), NUM_CLASSES, generator=g)
    y = (x.flatten(1) @ w).argmax(dim=1)
    return TensorDataset(x, y)


def initial_state(spec: Spec) -> Dict[str, torch.Tensor]:
    """The initial weights both contenders start from (the model built under ``SEED``)."""
    torch.manual_seed(SEED)
    return copy.deepcopy(MODELS[spec.model]().state_dict())


def quiet_logger(folder: str) -> logging.Logger:
    """A logger writing INFO lines to ``<folder>/train.log`` only (nothing on the console)."""
    logger = logging.getLogger("bench_loop.train")
    close_handlers(logger)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    handler = logging.FileHandler(os.path.join(folder, "train.log"), encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    return logger


def close_handlers(logger: logging.Logger) -> None:
    """Remove and close every handler of ``logger``."""
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()


class EpochClock(Callback):
    """Marks the end of every epoch (wall and CPU time); last in the callback list, it
    implements one event only."""

    def __init__(self, children: bool = False) -> None:
        super().__init__()
        self.children = children
        self.starts: List[tuple] = []
        self.ends: List[tuple] = []

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.ends.append(loop_stats.clock(self.children))


class BenchTrainer(trainer.EngineTrainer):
    """An :class:`~basetrainer.engine.trainer.EngineTrainer` on an in-memory data set.

    Args:
        cfg: the config (``batch_size``, ``num_epochs``, ``lr``, ``seed``, ``log_freq``...).
        spec: the comparison.
        dataset: the training set.
        state: the initial weights.
        work_dir: where LogHistory and ModelCheckpoint write (callbacks on).
        callbacks: ``"default"``, ``"loss"`` (LossesRecorder only) or ``"none"``.
    """

    def __init__(self, cfg: Any, spec: Spec, dataset: Dataset, state: Dict[str, torch.Tensor],
                 work_dir: str, callbacks: str) -> None:
        super().__init__(cfg)
        self.spec, self.dataset, self.state, self.work_dir = spec, dataset, state, work_dir
        self.callback_set = callbacks
        self.clock = EpochClock(children=spec.workers > 0)
        self.build(self.cfg)

    def set_epoch(self, epoch: int) -> None:
        self.clock.starts.append(loop_stats.clock(self.clock.children))
        super().set_epoch(epoch)

    def build_train_loader(self, cfg: Any, **kwargs: Any) -> DataLoader:
        # as documented, nothing else given: per-sample seeding on, persistent workers
        return self.build_dataloader(self.dataset, cfg.batch_size, cfg.num_workers, phase="train")

    def build_test_loader(self, cfg: Any, **kwargs: Any) -> None:
        return None

    def build_model(self, cfg: Any, **kwargs: Any) -> nn.Module:
        model = MODELS[self.spec.model]()
        model.load_state_dict(self.state)
        return self.build_model_parallel(model, cfg.gpu_id, distributed=cfg.distributed)

    def build_criterion(self, cfg: Any, **kwargs: Any) -> nn.Module:
        if self.spec.task == "regress":
            return nn.MSELoss()        # as examples/regression.py
        return get_criterion("CrossEntropyLoss", NUM_CLASSES, device=self.device)

    def build_optimizer(self, cfg: Any, **kwargs: Any) -> torch.optim.Optimizer:
        return get_optimizer(self.model, "SGD", lr=cfg.lr, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)

    def build_callbacks(self, cfg: Any, **kwargs: Any) -> List[Callback]:
        if self.callback_set == "none":
            return [self.clock]
        if self.callback_set == "loss":
            return [losses_recorder.LossesRecorder(indicator="loss"), self.clock]
        logger = quiet_logger(self.work_dir) if self.is_main_process else logging.getLogger("bench_loop.rank")
        names = [str(i) for i in range(NUM_CLASSES)]
        return [
            accuracy_recorder.AccuracyRecorder(target_names=names, indicator="Accuracy", logger=logger),
            losses_recorder.LossesRecorder(indicator="loss"),
            build_scheduler.get_scheduler("constant", optimizer=self.optimizer, lr_init=cfg.lr,
                                          num_epochs=cfg.num_epochs, num_steps=self.num_steps,
                                          num_warn_up=0),
            log_history.LogHistory(log_dir=os.path.join(self.work_dir, "log"), log_freq=cfg.log_freq,
                                   logger=logger, indicators=["loss", "Accuracy"],
                                   is_main_process=self.is_main_process),
            model_checkpoint.ModelCheckpoint(model=self.model, optimizer=self.optimizer,
                                             model_dir=os.path.join(self.work_dir, "model"),
                                             epochs=cfg.num_epochs, indicator="Accuracy", logger=logger),
            self.clock,
        ]


def run_basetrainer(spec: Spec, dataset: Dataset, state: Dict[str, torch.Tensor], epochs: int,
                    callbacks: str, patch: Optional[Callable[[BenchTrainer], None]] = None) -> RunResult:
    """Train with basetrainer and time it.

    Args:
        spec: the comparison.
        dataset: the training set.
        state: the initial weights.
        epochs: epochs to train.
        callbacks: ``"default"``, ``"loss"`` or ``"none"`` (see :class:`BenchTrainer`).
        patch: called with the built trainer before ``run()`` (to try a change of the library).

    Returns:
        The :class:`RunResult` (losses from ``history["train/loss"]`` when recorded).
    """
    with tempfile.TemporaryDirectory(prefix="bench_loop_") as work_dir:
        cfg = {"batch_size": spec.batch_size, "num_epochs": epochs, "lr": spec.lr, "seed": SEED,
               "gpu_id": [], "progress": False, "log_freq": 50, "distributed": spec.world > 1,
               "work_dir": work_dir, "num_workers": spec.workers}
        bt = BenchTrainer(cfg, spec, dataset, state, work_dir, callbacks)
        if patch is not None:
            patch(bt)
        t0 = time.perf_counter()
        history = bt.run()
        total = time.perf_counter() - t0
        starts, ends = bt.clock.starts, bt.clock.ends
        result = RunResult(epoch_s=[e[0] - s[0] for s, e in zip(starts, ends)],
                           run_epoch_s=(ends[-1][0] - starts[0][0]) / len(ends),
                           cpu_epoch_s=(ends[-1][1] - starts[0][1]) / len(ends),
                           outside_s=total - (ends[-1][0] - starts[0][0]),
                           weights={k: v.detach().cpu().clone() for k, v in bt.unwrapped_model.state_dict().items()})
        if "train/loss" in (history.last or {}):
            result.losses = [float(v) for v in history["train/loss"]]
        close_handlers(logging.getLogger("bench_loop.train"))  # its file is in work_dir
    del bt, history
    gc.collect()  # the trainer and its callbacks refer to each other: free the model now, not later
    return result


def run_hand(spec: Spec, dataset: Dataset, state: Dict[str, torch.Tensor], epochs: int,
             track_loss: bool) -> RunResult:
    """Train with a plain PyTorch loop and time it (DDP when a process group exists).

    Args:
        spec: the comparison.
        dataset: the training set.
        state: the initial weights.
        epochs: epochs to train.
        track_loss: keep the sample-weighted epoch loss (summed on the device, read once per
            epoch, summed over the ranks in DDP).

    Returns:
        The :class:`RunResult`.
    """
    t_begin = time.perf_counter()
    torch.manual_seed(SEED)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    model = MODELS[spec.model]()
    model.load_state_dict(state)
    net: nn.Module = nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.SGD(net.parameters(), lr=spec.lr, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    criterion = spec.loss()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    generator = torch.Generator()
    generator.manual_seed(SEED + 1000003 * rank)
    loader = DataLoader(dataset, batch_size=spec.batch_size // world, sampler=sampler, generator=generator,
                        num_workers=spec.workers)
    result = RunResult()
    first, first_cpu = loop_stats.clock(spec.workers > 0)
    for epoch in range(epochs):
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        net.train()
        loss_sum = torch.zeros(())
        count = 0
        for x, y in loader:
            loss = criterion(net(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if track_loss:
                loss_sum += loss.detach().float() * x.shape[0]
                count += x.shape[0]
        if track_loss:
            packed = torch.stack([loss_sum, torch.tensor(float(count))])
            if distributed:
                dist.all_reduce(packed)
            total_loss, total_count = packed.tolist()
            result.losses.append(total_loss / total_count)
        result.epoch_s.append(time.perf_counter() - t0)
    last, last_cpu = loop_stats.clock(spec.workers > 0)
    result.run_epoch_s = (last - first) / epochs
    result.cpu_epoch_s = (last_cpu - first_cpu) / epochs
    result.weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    result.outside_s = time.perf_counter() - t_begin - (last - first)
    del model, net, optimizer, loader
    gc.collect()  # as after a basetrainer run
    return result


def max_weight_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state_dicts' floating-point entries."""
    diffs = [(a[k].double() - b[k].double()).abs().max().item() for k in a
             if a[k].is_floating_point() and a[k].numel()]
    return max(diffs) if diffs else 0.0


def max_loss_diff(a: List[float], b: List[float]) -> float:
    """The largest absolute difference of two per-epoch loss lists (nan when one is missing)."""
    if not a or len(a) != len(b):
        return float("nan")
    return max(abs(x - y) for x, y in zip(a, b))


def compare(spec: Spec, repeats: int, warmup_epochs: int, callbacks: str,
            progress: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Alternate basetrainer (B) and the hand loop (H): a verification pair, then B,H repeats.

    The first pair (``warmup_epochs`` epochs, untimed) warms both up and checks equality: B
    records its loss (LossesRecorder when ``callbacks`` is ``"none"``; the full set otherwise)
    and H tracks its loss. Then ``repeats`` timed pairs run in the order B,H,H,B,B,H,...; the
    hand loop tracks its loss only when basetrainer's callbacks are on. Runs in every process of a
    DDP group (every rank must train); the figures are this process's.

    Args:
        spec: the comparison.
        repeats: timed pairs.
        warmup_epochs: epochs of the untimed first pair.
        callbacks: basetrainer's callback set in the timed runs (``"none"`` or ``"default"``).
        progress: called with one line per timed pair.

    Returns:
        A dict of raw figures: the per-run epoch times of each contender (``b``, ``h``), their
        paired ratios, the loss and weight differences, and the time outside the epochs.
    """
    dataset = make_dataset(spec)
    state = initial_state(spec)
    say = progress or (lambda _msg: None)
    check_set = "loss" if callbacks == "none" else callbacks
    b = run_basetrainer(spec, dataset, state, warmup_epochs, check_set)
    h = run_hand(spec, dataset, state, warmup_epochs, track_loss=True)
    exact = spec.data == "tensor"     # random augmentation draws differently in the two loops
    loss_diffs = [max_loss_diff(b.losses, h.losses) if exact else float("nan")]
    weight_diffs = [max_weight_diff(b.weights, h.weights) if exact else float("nan")]
    b_runs, h_runs, b_cpu, h_cpu, b_outside = [], [], [], [], []
    for i in range(repeats):  # B,H then H,B: a load that drifts during a pair hits both alike
        if i % 2 == 0:
            b = run_basetrainer(spec, dataset, state, spec.epochs, callbacks)
        h = run_hand(spec, dataset, state, spec.epochs, track_loss=callbacks != "none")
        if i % 2 == 1:
            b = run_basetrainer(spec, dataset, state, spec.epochs, callbacks)
        b_runs.append(b.run_epoch_s)
        h_runs.append(h.run_epoch_s)
        b_cpu.append(b.cpu_epoch_s)
        h_cpu.append(h.cpu_epoch_s)
        b_outside.append(b.outside_s)
        if exact:
            weight_diffs.append(max_weight_diff(b.weights, h.weights))
        if callbacks != "none" and exact:
            loss_diffs.append(max_loss_diff(b.losses, h.losses))
        say(f"    repeat {i + 1}/{repeats}: basetrainer {b.run_epoch_s * 1e3:8.1f} ms/epoch "
            f"(CPU {b.cpu_epoch_s * 1e3:.1f}), hand {h.run_epoch_s * 1e3:8.1f} ms/epoch "
            f"(CPU {h.cpu_epoch_s * 1e3:.1f}), ratio {b.run_epoch_s / h.run_epoch_s:.3f} "
            f"(CPU {b.cpu_epoch_s / h.cpu_epoch_s:.3f})")
    return {"b": b_runs, "h": h_runs, "ratios": [x / y for x, y in zip(b_runs, h_runs)],
            "b_cpu": b_cpu, "h_cpu": h_cpu,
            "loss_diff": max(loss_diffs), "weight_diff": max(weight_diffs), "b_outside": b_outside,
            "checked_epochs": warmup_epochs}


def ddp_entry(spec: Spec, repeats: int, warmup_epochs: int, out_file: str) -> None:
    """The body of each DDP process (started by :func:`basetrainer.engine.launch.launch`):
    :func:`compare` with callbacks off.

    One thread per process (2 processes share the 2 cores); rank 0 writes the figures to
    ``out_file`` as JSON.
    """
    torch.set_num_threads(1)
    logging.getLogger("basetrainer").setLevel(logging.ERROR)
    say = (lambda msg: print(msg, flush=True)) if dist.get_rank() == 0 else None
    result = compare(spec, repeats, warmup_epochs, "none", progress=say)
    for key in ("b_cpu", "h_cpu"):   # CPU time: the ranks' together
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, result[key])
        result[key] = [sum(runs) for runs in zip(*every)]
    dist.barrier()
    if dist.get_rank() == 0:
        with open(out_file, "w", encoding="utf-8") as f:
            json.dump(result, f)
