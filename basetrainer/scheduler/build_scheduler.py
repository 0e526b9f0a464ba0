"""Learning-rate schedules with linear warm-up, applied per optimizer step, as a callback.

Each schedule is a factor ``f(t)`` of the epoch position ``t`` (fractional: step k of an epoch
of n steps is ``epoch + k / n``); the LR of a step is ``base_lr * warmup(k) * f(t)``, set through
:class:`torch.optim.lr_scheduler.LambdaLR` before any callback's ``on_batch_begin`` of that step.
Each parameter group has its own ``base_lr``: ``lr_init`` replaces the optimizer's default LR, so
groups built with the default take it and groups given an LR of their own (a backbone at a tenth
of the head's, say) keep theirs.
"""
import logging
import math
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from basetrainer.callbacks.callbacks import Callback
from basetrainer.runtime import comm
from basetrainer.runtime.errors import ConfigError
from basetrainer.utils.setup_config import LR_RULE, MILESTONES_RULE, SCHEDULE_ON_RESUME, valid_lr, valid_milestones

logger = logging.getLogger(__name__)


def _multi_step(milestones: Sequence[int], gamma: float, **_: Any) -> Callable[[float, float], float]:
    stones = sorted(int(m) for m in milestones or ())
    return lambda t, _t0: gamma ** sum(1 for m in stones if int(t) >= m)


def _step(step_size: int, gamma: float, **_: Any) -> Callable[[float, float], float]:
    return lambda t, _t0: gamma ** (int(t) // step_size)


def _exponential(gamma: float, **_: Any) -> Callable[[float, float], float]:
    return lambda t, _t0: gamma ** int(t)


def _cosine(num_epochs: int, lr_min_ratio: float, **_: Any) -> Callable[[float, float], float]:
    def factor(t: float, t0: float) -> float:  # cosine over the epochs after warm-up
        span = max(num_epochs - t0, 1e-12)
        progress = min(max((t - t0) / span, 0.0), 1.0)
        return lr_min_ratio + (1.0 - lr_min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def _constant(**_: Any) -> Callable[[float, float], float]:
    return lambda t, _t0: 1.0


_SCHEDULERS: Dict[str, Callable[..., Callable[[float, float], float]]] = {
    "multi-step": _multi_step,
    "cosine": _cosine,
    "step": _step,
    "exponential": _exponential,
    "constant": _constant,
}
_ALIASES = {"multistep": "multi-step", "multi_step": "multi-step", "multisteplr": "multi-step",
            "cos": "cosine", "cosineannealinglr": "cosine", "steplr": "step", "exp": "exponential",
            "exponentiallr": "exponential", "none": "constant", "fixed": "constant"}


def scheduler_names() -> List[str]:
    return sorted(_SCHEDULERS)


def _canonical(name: str) -> str:
    if not isinstance(name, str):
        raise ConfigError(f"scheduler={name!r} must be a string; choose from {scheduler_names()}")
    key = name.strip().lower()
    key = _ALIASES.get(key.replace("-", "").replace("_", ""), _ALIASES.get(key, key))
    if key not in _SCHEDULERS:
        raise ConfigError(f"unknown scheduler {name!r}; choose from {scheduler_names()}")
    return key


#: what ``schedule_on_resume`` accepts: what the schedule does when a resume changes num_epochs
ON_RESUME = SCHEDULE_ON_RESUME


class LRSchedulerCallback(Callback):
    """Sets the LR of every optimizer step and writes it to ``logs["lr"]`` (the LR of the groups
    at the optimizer's default LR).

    It positions a :class:`torch.optim.lr_scheduler.LambdaLR` at the global optimizer step
    before each step, so it is exact after a resume and with gradient accumulation (it counts
    optimizer steps, ``ceil(num_steps / accumulate_steps)`` per epoch).

    A resume with another ``num_epochs`` than the checkpoint's (e.g. raised to train a finished
    run on) does what ``on_resume`` says (default: the trainer's config key
    ``schedule_on_resume``, else ``stretch``), and logs one line with the LR before and after:

    - ``stretch``: the schedule is recomputed for the new ``num_epochs`` and goes on from the
      step reached (a cosine then jumps to where the longer curve is at that step);
    - ``restart``: a new schedule, warm-up included, over the epochs left, from the step reached
      (a warm restart).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, name: str, factor: Callable[[float, float], float],
                 num_steps: int, num_warn_up: float = 0, num_epochs: Optional[int] = None,
                 make: Optional[Callable[[float], Callable[[float, float], float]]] = None,
                 on_resume: Optional[str] = None) -> None:
        super().__init__()
        if on_resume is not None and on_resume not in ON_RESUME:
            raise ConfigError(f"on_resume={on_resume!r} must be one of {list(ON_RESUME)}")
        self.num_epochs = num_epochs   # the length the schedule is built for (None: unknown)
        self.make = make               # length in epochs -> factor: rebuilds the schedule for another length
        self.on_resume = on_resume
        self.origin = 0                # the global optimizer step the schedule starts from (a restart moves it)
        self._saved: Optional[Dict[str, Any]] = None   # a loaded state, applied when the run begins
        if not isinstance(num_steps, int) or num_steps <= 0:
            raise ValueError(f"num_steps={num_steps!r} must be the number of train batches per epoch "
                             f"(len(train_loader)), a positive integer")
        if num_warn_up is None or num_warn_up < 0:
            raise ConfigError(f"num_warn_up={num_warn_up!r} must be a number of epochs >= 0")
        self.optimizer = optimizer
        self.name = name
        self.factor = factor
        self.num_steps = num_steps
        self.num_warn_up = float(num_warn_up)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=self.lr_factor)
        # logs["lr"] is the LR of the first group at the optimizer's default LR (the config's lr),
        # not that of a group with an LR of its own; group 0's when no group has the default
        default = optimizer.defaults.get("lr")
        self.logged_group = next((i for i, base in enumerate(self.scheduler.base_lrs)
                                  if default is not None and float(base) == float(default)), 0)

    @property
    def _accumulate(self) -> int:
        return int(getattr(self.trainer, "accumulate_steps", 1) or 1)

    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch."""
        return -(-self.num_steps // self._accumulate)

    def lr_factor(self, step: int) -> float:
        """The multiplier of the initial LR at global optimizer step ``step``."""
        n = self.steps_per_epoch()
        step -= self.origin
        warm_steps = self.num_warn_up * n
        warm = min(1.0, (step + 1) / warm_steps) if warm_steps > 0 else 1.0
        return warm * self.factor(step / n, self.num_warn_up)

    def lr_at(self, step: int) -> List[float]:
        """The LR of every parameter group at global optimizer step ``step``."""
        return [base * self.lr_factor(step) for base in self.scheduler.base_lrs]

    def on_batch_prepare(self, epoch: int, batch: int, logs: Optional[dict] = None) -> None:
        step = epoch * self.steps_per_epoch() + batch // self._accumulate
        # always set: the LR LambdaLR set at construction was computed before the trainer (and
        # so accumulate_steps) was known, so step 0 must be recomputed too. Setting the groups
        # directly keeps this per-step work to one factor (no LambdaLR.step()/warnings context).
        factor = self.lr_factor(step)
        lrs = [base * factor for base in self.scheduler.base_lrs]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self.scheduler.last_epoch = step
        self.scheduler._last_lr = lrs
        if logs is not None:
            logs["lr"] = self.optimizer.param_groups[self.logged_group]["lr"]

    def state_dict(self) -> Dict[str, Any]:
        state = {"last_step": int(self.scheduler.last_epoch), "base_lrs": list(self.scheduler.base_lrs),
                 "origin": int(self.origin)}
        if self.num_epochs is not None:
            state["num_epochs"] = int(self.num_epochs)
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        # the LRs after warm-up stay those this schedule was built with, i.e. the current
        # config's (a changed lr on resume takes effect); the position is recomputed every step
        self.scheduler.last_epoch = int(state.get("last_step", self.scheduler.last_epoch))
        self._saved = dict(state)   # the length it had: applied in on_train_begin (the trainer is known there)

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        saved, self._saved = self._saved, None
        if saved is None:
            return
        self._place(int(saved.get("origin", 0)))
        before = saved.get("num_epochs")
        if before is None or self.num_epochs is None or int(before) == self.num_epochs:
            return
        policy = self.on_resume or _config_key(self.trainer, "schedule_on_resume") or "stretch"
        last = int(saved.get("last_step", -1))
        step = int(getattr(self.trainer, "global_step", last + 1))
        old = self._factor_at(last, int(saved.get("origin", 0)), float(before))
        if policy == "restart" and self.make is not None:
            self._place(step)
            what = (f"starts over at step {step} for the {self.num_epochs - step / self.steps_per_epoch():g} "
                    f"epochs left (schedule_on_resume: restart; warm-up included)")
            other = "stretch recomputes it for the new num_epochs and goes on instead"
        else:
            what = f"is recomputed for {self.num_epochs} epochs and goes on from step {step} (schedule_on_resume: stretch)"
            other = "restart starts a new one over the epochs left instead"
        if comm.is_main_process():
            base = self.scheduler.base_lrs[self.logged_group]
            logger.info("num_epochs %s -> %d on resume: the %s LR schedule %s; the LR goes from %.3g (step %d) to "
                        "%.3g (step %d); schedule_on_resume: %s", before, self.num_epochs, self.name, what,
                        base * old, last, base * self.lr_factor(step), step, other)

    def _place(self, origin: int) -> None:
        """Start the schedule at global step ``origin``, over the epochs from there to ``num_epochs``."""
        self.origin = origin
        if self.make is not None and self.num_epochs is not None:
            self.factor = self.make(self.num_epochs - origin / self.steps_per_epoch())

    def _factor_at(self, step: int, origin: int, num_epochs: float) -> float:
        """The factor at ``step`` of the schedule that starts at ``origin`` and ends at ``num_epochs``."""
        if self.make is None:
            return self.lr_factor(step)
        saved = self.origin, self.factor
        try:
            self.origin, self.factor = origin, self.make(num_epochs - origin / self.steps_per_epoch())
            return self.lr_factor(step)
        finally:
            self.origin, self.factor = saved


def _config_key(trainer: Any, key: str) -> Any:
    cfg = getattr(trainer, "cfg", None)
    return cfg.get(key) if hasattr(cfg, "get") else None


def _replace_default_lr(optimizer: torch.optim.Optimizer, lr_init: float) -> None:
    """Make ``lr_init`` the optimizer's default LR: the groups at the old default take it, the
    groups given an LR of their own keep theirs; every group's LR becomes its schedule's base."""
    default = optimizer.defaults.get("lr")
    for group in optimizer.param_groups:
        if default is None or float(group["lr"]) == float(default):
            group["lr"] = lr_init
        group["initial_lr"] = group["lr"]
    optimizer.defaults["lr"] = lr_init


def get_scheduler(scheduler: str, optimizer: torch.optim.Optimizer, lr_init: Optional[float] = None,
                  num_epochs: int = 1, num_steps: int = 1, milestones: Optional[Sequence[int]] = None,
                  num_warn_up: float = 0, gamma: Optional[float] = None, step_size: Optional[int] = None,
                  lr_min: float = 0.0, on_resume: Optional[str] = None, **kwargs: Any) -> LRSchedulerCallback:
    """Build an LR schedule callback.

    Args:
        scheduler: ``multi-step``, ``cosine``, ``step``, ``exponential`` or ``constant``.
        optimizer: the optimizer whose groups' LR is set.
        lr_init: the LR after warm-up. It replaces the optimizer's default LR
            (``optimizer.defaults["lr"]``): groups at the default take it, groups given an LR of
            their own keep theirs. Default: every group keeps its current LR. A finite number >= 0.
        num_epochs: total epochs (cosine anneals to ``lr_min`` at the end).
        num_steps: train batches per epoch (``len(train_loader)``, the trainer's ``num_steps``);
            with ``accumulate_steps`` the schedule counts ``ceil(num_steps / accumulate_steps)``
            optimizer steps per epoch.
        milestones: 0-based epochs from which the LR is multiplied by ``gamma`` (multi-step):
            integers >= 0.
        num_warn_up: epochs of linear warm-up, applied per optimizer step: step k of the warm-up
            has LR ``lr_init * (k + 1) / (num_warn_up * S)``, S the optimizer steps per epoch
            (``num_steps`` without accumulation).
        gamma: decay factor (0.1 for multi-step/step, 0.95 per epoch for exponential).
        step_size: epochs between decays for ``step`` (default: a third of ``num_epochs``).
        lr_min: the final LR of ``cosine`` for the groups at the default LR; a group with an LR of
            its own ends at the same fraction of it. Below the LR (0 when the LR is 0).
        on_resume: when a resume changes ``num_epochs``: ``stretch`` (recompute the schedule for
            the new length, going on from the step reached) or ``restart`` (a new schedule over
            the epochs left). Default: the trainer's config key ``schedule_on_resume``.

    Returns:
        An :class:`LRSchedulerCallback`; put it in the trainer's callbacks.

    Raises:
        ValueError: unknown name, or out-of-range numbers.
    """
    name = _canonical(scheduler)
    if not isinstance(num_epochs, int) or num_epochs <= 0:
        raise ConfigError(f"num_epochs={num_epochs!r} must be a positive integer")
    if lr_init is not None:
        if not valid_lr(lr_init):
            raise ConfigError(f"lr_init={lr_init!r} {LR_RULE}")
        _replace_default_lr(optimizer, float(lr_init))
    if milestones is not None and not isinstance(milestones, (list, tuple)):
        milestones = [milestones]
    if milestones is not None and not valid_milestones(milestones):
        raise ConfigError(f"milestones={list(milestones)!r} {MILESTONES_RULE}")
    late = [m for m in (milestones or []) if int(m) >= num_epochs]
    if name == "multi-step" and late:
        logger.warning("milestones %s are beyond num_epochs=%d (epochs are 0-based): they never apply",
                       late, num_epochs)
    if num_warn_up and num_warn_up >= num_epochs:
        logger.warning("num_warn_up=%s covers all num_epochs=%d: the LR never reaches lr_init's schedule",
                       num_warn_up, num_epochs)
    base_lr = float(optimizer.defaults.get("lr", optimizer.param_groups[0]["lr"]))
    if not valid_lr(base_lr):
        raise ValueError(f"the optimizer's lr={base_lr!r} {LR_RULE}")
    if gamma is None:
        gamma = 0.95 if name == "exponential" else 0.1
    if step_size is None:
        step_size = max(1, num_epochs // 3)
    if not isinstance(step_size, int) or step_size <= 0:
        raise ValueError(f"step_size={step_size!r} must be a positive integer number of epochs")
    if not valid_lr(lr_min):
        raise ValueError(f"lr_min={lr_min!r} must be a finite number >= 0 and below lr={base_lr}")
    if base_lr == 0 and lr_min != 0:
        raise ValueError(f"lr_min={lr_min!r} must be 0 when the lr is 0 (nothing to anneal); leave lr_min out")
    if base_lr > 0 and lr_min >= base_lr:
        raise ValueError(f"lr_min={lr_min!r} must be >= 0 and below lr={base_lr}")
    def make(length: float) -> Callable[[float, float], float]:   # the schedule over ``length`` epochs
        return _SCHEDULERS[name](milestones=milestones or [], gamma=gamma, step_size=step_size,
                                 num_epochs=length, lr_min_ratio=lr_min / base_lr if base_lr else 0.0)

    return LRSchedulerCallback(optimizer, name, make(num_epochs), num_steps=num_steps, num_warn_up=num_warn_up or 0,
                               num_epochs=num_epochs, make=make, on_resume=on_resume)
