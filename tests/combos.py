"""The option space of a training run, a pairwise set of configs over it, and one run of a config.

:mod:`test_combos` checks the engine's promises on every config :func:`generate` gives; this
module is also the command that reruns one config alone, as a failure prints it::

    python tests/combos.py --config c07            # the default set (seed 0)
    python tests/combos.py --seed 3 --config c11   # a config of another drawn set

Factors and their levels are :data:`FACTORS`. A combination the project refuses by design
(:data:`REFUSED`) is never generated as a run; a config of its own checks the refusal instead.
"""
import argparse
import faulthandler
import itertools
import json
import os
import random
import signal
import sys
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

from basetrainer.callbacks.callbacks import Callback   # noqa: E402
from basetrainer.engine.trainer import EngineTrainer   # noqa: E402
from toys import StopAt   # noqa: E402

FACTORS: Dict[str, Tuple[Any, ...]] = {
    "strategy": ("one", "ddp2", "ddp3", "fsdp2"),
    "data": ("even", "uneven"),            # divides the global batch and the ranks, or not
    "workers": (0, 2),                     # 2: worker processes and random augmentation
    "precision": ("fp32", "bf16"),         # bf16: autocast
    "accumulate": (1, 3),
    "clip": (False, True),
    "ema": (False, True),                  # ModelEMA(evaluate=True)
    "model": ("convbn", "mlp", "twoout"),  # conv + BatchNorm on 1-channel images; MLP; two outputs, a dict of losses
    "balance": ("none", "sqrt"),
    "compile": (False, True),
    "resume": ("none", "kill"),            # kill: SIGKILL mid-epoch, then resume: auto
    "callbacks": ("minimal", "full"),      # full: the example's set + EvalReport
    "dropout": (False, True),              # the model draws from the process's generator while training
}
NAMES = tuple(FACTORS)

#: pairs of levels the project refuses by design, and a word the refusal must name
REFUSED: Dict[Tuple[Tuple[str, Any], Tuple[str, Any]], str] = {
    (("strategy", "fsdp2"), ("compile", True)): "compile",
}
#: what a level costs in time, so the generator takes it only where it covers more pairs
COST = {("compile", True): 3.0, ("resume", "kill"): 1.0, ("strategy", "ddp3"): 0.5,
        ("dropout", True): 1.0}   # dropout: invariant 1 does not apply there

WORLD = {"one": 1, "ddp2": 2, "ddp3": 3, "fsdp2": 2}
BATCH, EPOCHS, KILL_AT = 12, 2, (1, 3)    # global batch; epochs; SIGKILL after this (epoch, step)
STACKS_AFTER_S = 90   # a config's rank still running after this long dumps its stacks (one takes ~5-30 s)
SIZES = {("even", "train"): 72, ("uneven", "train"): 77, ("even", "test"): 24, ("uneven", "test"): 29}
CLASSES, SHARES = 4, (0.4, 0.3, 0.2, 0.1)  # imbalanced, so that balance: sqrt changes the epochs


@dataclass(frozen=True)
class Combo:
    """One config: a level of every factor."""
    strategy: str = "one"
    data: str = "even"
    workers: int = 0
    precision: str = "fp32"
    accumulate: int = 1
    clip: bool = False
    ema: bool = False
    model: str = "mlp"
    balance: str = "none"
    compile: bool = False
    resume: str = "none"
    callbacks: str = "minimal"
    dropout: bool = False
    cid: str = ""

    @property
    def world(self) -> int:
        return WORLD[self.strategy]

    def levels(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "cid"}

    def refusal(self) -> Optional[str]:
        """The word the project's refusal of this config must name (None: it runs)."""
        levels = self.levels()
        for (a, b), word in REFUSED.items():
            if levels[a[0]] == a[1] and levels[b[0]] == b[1]:
                return word
        return None

    def describe(self) -> str:
        on = [n for n in ("clip", "ema", "compile", "dropout") if getattr(self, n)]
        return "-".join([self.strategy, self.model, self.data, f"w{self.workers}", self.precision,
                         f"acc{self.accumulate}", self.balance, self.resume, self.callbacks] + on)

    def reference(self) -> "Combo":
        """The same config in one process, uninterrupted: what invariant 1 compares with."""
        return replace(self, strategy="one", resume="none")


# ---------------------------------------------------------------------------------- generation
def _pairs(levels: Dict[str, Any]) -> Iterator[Tuple[Tuple[str, Any], Tuple[str, Any]]]:
    for a, b in itertools.combinations(NAMES, 2):
        if a in levels and b in levels:
            yield (a, levels[a]), (b, levels[b])


def all_pairs() -> List[Tuple[Tuple[str, Any], Tuple[str, Any]]]:
    return [((a, x), (b, y)) for a, b in itertools.combinations(NAMES, 2) for x in FACTORS[a] for y in FACTORS[b]]


def _complete(partial: Dict[str, Any], uncovered: set, rng: random.Random, tries: int = 24) -> Dict[str, Any]:
    """The completion of ``partial`` that covers most uncovered pairs (less the levels' cost),
    factor by factor in a drawn order, best of ``tries`` orders; never a refused pair."""
    best, best_score = None, None
    for _ in range(tries):
        levels = dict(partial)
        free = [n for n in NAMES if n not in levels]
        rng.shuffle(free)
        for name in free:
            options = []
            for level in FACTORS[name]:
                trial = {**levels, name: level}
                if any(p in REFUSED for p in _pairs(trial)):
                    continue
                new = sum(1 for p in _pairs(trial) if name in (p[0][0], p[1][0]) and p in uncovered)
                options.append((new - COST.get((name, level), 0.0), rng.random(), level))
            levels[name] = max(options)[2]
        score = sum(1 for p in _pairs(levels) if p in uncovered) - sum(COST.get(kv, 0.0) for kv in levels.items())
        if best_score is None or score > best_score:
            best, best_score = levels, score
    return best


def generate(seed: int = 0) -> List[Combo]:
    """The configs: a fixed 3-wise core (every strategy x model x EMA and strategy x model x
    precision), completed and extended until every pair of levels of two factors occurs in a
    config that runs, and one config per refused pair. Deterministic for a seed."""
    rng = random.Random(seed)
    uncovered = set(all_pairs()) - set(REFUSED)
    chosen: List[Dict[str, Any]] = []
    core = [{"strategy": s, "model": m, "ema": e, "precision": p}
            for s in FACTORS["strategy"] for m in FACTORS["model"] for e, p in ((False, "fp32"), (True, "bf16"))]
    for partial in core:
        levels = _complete(partial, uncovered, rng)
        uncovered -= set(_pairs(levels))
        chosen.append(levels)
    while uncovered:
        (a, x), (b, y) = rng.choice(sorted(uncovered, key=repr))   # sorted: set order varies with str hashing
        levels = _complete({a: x, b: y}, uncovered, rng)
        uncovered -= set(_pairs(levels))
        chosen.append(levels)
    for (a, x), (b, y) in REFUSED:
        chosen.append({**Combo().levels(), a: x, b: y})
    return [Combo(**levels, cid=f"c{i:02d}") for i, levels in enumerate(chosen)]


def coverage(combos: Sequence[Combo]) -> Tuple[int, int]:
    """(pairs covered, pairs in all): a refused pair counts as covered by the config that checks its refusal."""
    covered = set()
    for c in combos:
        covered |= set(_pairs(c.levels()))
    return len(covered & set(all_pairs())), len(all_pairs())


# ---------------------------------------------------------------------------------- the run
class ComboData(Dataset):
    """Class-imbalanced blobs: 16 features, or 1-channel 8x8 images for the conv model. With
    ``augment``, random noise from torch, numpy and python's random, as augmentations draw it."""

    def __init__(self, combo: Combo, phase: str) -> None:
        n = SIZES[combo.data, phase]
        counts = [int(round(s * n)) for s in SHARES]
        counts[0] += n - sum(counts)
        g = torch.Generator().manual_seed(0 if phase == "train" else 1)
        y = torch.tensor(sum(([c] * k for c, k in enumerate(counts)), []))
        y = y[torch.randperm(n, generator=g)]
        centres = torch.randn(CLASSES, 64 if combo.model == "convbn" else 16, generator=torch.Generator().manual_seed(7))
        x = centres[y] * 1.5 + torch.randn(n, centres.shape[1], generator=g)
        self.x = x.view(n, 1, 8, 8) if combo.model == "convbn" else x
        self.targets = y.tolist()
        self.augment = phase == "train" and combo.workers > 0

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, int]:
        x = self.x[i]
        if self.augment:
            x = x + 0.2 * torch.randn(x.shape) + 0.1 * float(np.random.rand()) - 0.1 * random.random()
        return x, self.targets[i]


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(2))
        self.head = nn.Linear(24, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class TwoOutputs(nn.Module):
    """Class scores and a regression output (the class index as a number)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 24), nn.ReLU())
        self.cls, self.reg = nn.Linear(24, CLASSES), nn.Linear(24, 1)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.cls(h), self.reg(h)


def build_model(combo: Combo) -> nn.Module:
    torch.manual_seed(0)
    if combo.model == "convbn":
        model = ConvBN()
    elif combo.model == "twoout":
        model = TwoOutputs()
    else:
        model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, CLASSES))
    if combo.dropout:   # on the input: the same place in every model
        model = nn.Sequential(nn.Dropout(0.2), model)
    return model


class ComboTrainer(EngineTrainer):
    """The trainer every config builds (its hooks read the combo)."""

    def __init__(self, cfg: Any, combo: Combo, kill: bool = False, callbacks: Optional[str] = None) -> None:
        super().__init__(cfg)
        self.combo, self.kill = combo, kill
        self.callback_set = callbacks or combo.callbacks
        self.build(self.cfg)

    def build_train_loader(self, cfg: Any, **kwargs: Any) -> Any:
        return self.build_dataloader(ComboData(self.combo, "train"), cfg.batch_size, cfg.num_workers, phase="train")

    def build_test_loader(self, cfg: Any, **kwargs: Any) -> Any:
        return self.build_dataloader(ComboData(self.combo, "test"), cfg.batch_size, 0, phase="test", shuffle=False)

    def build_model(self, cfg: Any, **kwargs: Any) -> nn.Module:
        return self.build_model_parallel(build_model(self.combo), cfg.gpu_id, distributed=cfg.distributed)

    def build_criterion(self, cfg: Any, **kwargs: Any) -> nn.Module:
        return nn.CrossEntropyLoss()

    def build_optimizer(self, cfg: Any, **kwargs: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=0.9)

    def run_step(self, inputs: Any) -> Tuple[Any, Any]:
        if self.combo.model != "twoout":
            return super().run_step(inputs)
        x, y = inputs
        logits, value = self.model(x)
        return (logits, value), {"cls": self.criterion(logits, y),
                                 "reg": 0.1 * nn.functional.mse_loss(value.squeeze(1).float(), y.float())}

    def build_callbacks(self, cfg: Any, **kwargs: Any) -> List[Callback]:
        from basetrainer.callbacks import log_history, losses_recorder, model_checkpoint
        from basetrainer.callbacks.model_ema import ModelEMA
        from basetrainer.metric import accuracy_recorder

        work = cfg.work_dir
        ema = [ModelEMA(decay=0.8, evaluate=True)] if self.combo.ema else []
        steps = 1 if self.combo.resume == "kill" else 0
        if self.callback_set == "none":    # figures only (evaluating a weights file)
            return [losses_recorder.LossesRecorder(indicator="loss"),
                    accuracy_recorder.AccuracyRecorder(indicator="Accuracy")]
        if self.callback_set == "minimal":
            found = [losses_recorder.LossesRecorder(indicator="loss"), *ema,
                     model_checkpoint.ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="loss",
                                                      start_save=1, save_freq_steps=steps, async_save=False)]
        else:
            from basetrainer.callbacks.eval_report import EvalReport
            from basetrainer.scheduler import build_scheduler

            found = [accuracy_recorder.AccuracyRecorder(indicator="Accuracy"),
                     losses_recorder.LossesRecorder(indicator="loss"),
                     build_scheduler.get_scheduler("cosine", optimizer=self.optimizer, lr_init=cfg.lr,
                                                   num_epochs=cfg.num_epochs, num_steps=self.num_steps,
                                                   milestones=[1], num_warn_up=1),
                     log_history.LogHistory(log_dir=os.path.join(work, "log"), log_freq=cfg.log_freq,
                                            indicators=["loss", "Accuracy"], is_main_process=self.is_main_process),
                     *ema,
                     model_checkpoint.ModelCheckpoint(model=self.model, optimizer=self.optimizer,
                                                      model_dir=os.path.join(work, "model"), epochs=cfg.num_epochs,
                                                      start_save=1, indicator="Accuracy", save_freq_steps=steps,
                                                      async_save=False),
                     EvalReport(out_dir=os.path.join(work, "eval"), topk=(1, 2), tensorboard=False, trackers=False)]
        return found + ([StopAt(*KILL_AT, how=signal.SIGKILL, rank=0)] if self.kill else [])


def config_of(combo: Combo, work: str, resume: str = "", **overrides: Any) -> Dict[str, Any]:
    """The engine config of ``combo`` (CPU; one process per rank of its strategy)."""
    world = combo.world
    cfg = dict(gpu_id=[], progress=False, num_epochs=EPOCHS, batch_size=BATCH, lr=0.05, log_freq=2, seed=0,
               work_dir=work, resume=resume, num_workers=combo.workers, distributed=world > 1,
               strategy="fsdp" if combo.strategy == "fsdp2" else "ddp", sync_bn=world > 1 and combo.model == "convbn",
               amp="bf16" if combo.precision == "bf16" else "none", accumulate_steps=combo.accumulate,
               clip_grad_norm=0.5 if combo.clip else 0.0, balance=combo.balance, compile=combo.compile,
               weight_decay=0.0)
    cfg.update(overrides)
    return cfg


def _floats(logs: Dict[str, Any]) -> Dict[str, float]:
    return {k: float(v) for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _cpu(obj: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.full_tensor().detach().cpu().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    return obj


def full_weights(trainer: EngineTrainer) -> Dict[str, torch.Tensor]:
    """The whole model's state dict on the CPU (gathered from the shards under fsdp; every rank calls)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if trainer.strategy == "fsdp":
        return _cpu(get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True,
                                                                                 cpu_offload=True)))
    return _cpu(trainer.unwrapped_model.state_dict())


def train(combo: Combo, work: str, resume: str = "", kill: bool = False) -> Dict[str, Any]:
    """One run of ``combo`` in this process (a rank of its world, or the one process): the final
    weights, the EMA average, the history, ``evaluate()`` and ``predict()`` of the test set, and
    the weights files it wrote. A refused config returns the refusal's message."""
    try:
        trainer = ComboTrainer(config_of(combo, work, resume), combo, kill=kill)
    except (ValueError, TypeError) as e:
        if combo.refusal():
            return {"refused": f"{type(e).__name__}: {e}"}
        raise
    if combo.refusal():
        return {"refused": None}
    trainer.run()
    ema = next((c for c in trainer.callbacks if type(c).__name__ == "ModelEMA"), None)
    result = {"weights": full_weights(trainer), "ema": _cpu(ema.ema) if ema is not None else None,
              "history": [_floats(e) for e in trainer.history.epochs]}
    result["evaluate"] = _floats(trainer.evaluate())
    result["predict"] = _cpu(trainer.predict(ComboData(combo, "test")))
    model_dir = os.path.join(work, "model")
    result["files"] = sorted(os.listdir(model_dir)) if os.path.isdir(model_dir) else []
    return result


# ---------------------------------------------------------------------------------- processes
def _rank_main(combos: List[Combo], root: str, stage: str) -> None:
    """Each rank: run ``combos`` one after the other (``stage``: run, kill or resume) and save
    its results as ``<root>/<cid>/<stage>-rank<r>.pt``; a failure is saved too, then the job ends."""
    import traceback

    from basetrainer.runtime import comm

    for combo in combos:
        folder = os.path.join(root, combo.cid)
        os.makedirs(folder, exist_ok=True)
        out = os.path.join(folder, f"{stage}-rank{comm.get_rank()}.pt")
        # a rank still in this config after STACKS_AFTER_S writes where it is (every thread), so a
        # config that hangs or times out says where each rank was (combo_checks reads the files)
        with open(os.path.join(folder, f"{stage}-rank{comm.get_rank()}.stacks.txt"), "w") as stacks:
            faulthandler.dump_traceback_later(STACKS_AFTER_S, file=stacks)
            try:
                result = train(combo, os.path.join(folder, stage if stage == "run" else "killed"),
                               resume="auto" if stage == "resume" else "", kill=stage == "kill")
            except BaseException:
                torch.save({"error": traceback.format_exc()}, out)
                sys.stderr.write(f"{combo.cid} failed on rank {comm.get_rank()}:\n{traceback.format_exc()}")
                sys.stderr.flush()
                os._exit(1)
            finally:
                faulthandler.cancel_dump_traceback_later()
        torch.save(result, out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the generator's seed (0: the default set)")
    parser.add_argument("--config", help="rerun this config (e.g. c07) alone and check every invariant")
    parser.add_argument("--list", action="store_true", help="print the configs and their coverage")
    parser.add_argument("--ranks", help=argparse.SUPPRESS)     # internal: run these configs as one job's ranks
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--stage", default="run", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    combos = {c.cid: c for c in generate(args.seed)}
    if args.ranks:   # one job: launch() starts world processes (gloo on the CPU)
        from basetrainer.engine.launch import launch

        chosen = [combos[c] for c in args.ranks.split(",")]
        world = chosen[0].world
        launch(_rank_main, num_gpus_per_machine=world, dist_url="auto", distributed=world > 1,
               args=(chosen, args.root, args.stage), timeout=120)
        return 0
    if args.list or not args.config:
        covered, total = coverage(list(combos.values()))
        for c in combos.values():
            print(c.cid, c.describe(), f"(refused: {c.refusal()})" if c.refusal() else "")
        print(f"{len(combos)} configs, {covered}/{total} pairs covered")
        return 0
    import tempfile

    from combo_checks import check_one

    with tempfile.TemporaryDirectory(prefix=f"combo-{args.config}-") as root:
        failures = check_one(combos[args.config], root, seed=args.seed)
    print(json.dumps({"config": args.config, "levels": asdict(combos[args.config]), "failures": failures}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
