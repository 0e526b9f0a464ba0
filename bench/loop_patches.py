"""What-if experiments: cheaper versions of hot-path pieces of the library, applied by
monkeypatching one trainer's callbacks during a benchmark run (the library files are untouched).

Each patch keeps the figures the same (the LR of every step, the accuracy counts, the loss sums,
the files' contents) and only changes how they are computed or written:

- ``accuracy``: AccuracyRecorder keeps each step's (targets, argmax) and folds them into the
  confusion matrix when a figure is read (every ``log_freq`` steps), instead of 6-7 small
  tensor ops per step.
- ``lr``: LRSchedulerCallback sets ``param_group["lr"] = base_lr * lr_factor(step)`` directly,
  instead of entering ``warnings.catch_warnings()`` and calling ``LambdaLR.step()`` per step.
- ``loss``: LossesRecorder's running sums add in place (``sum.add_(loss, alpha=n)``).
- ``checkpoint``: ModelCheckpoint writes ``best_model_*.pth`` as a hard link to the
  ``model_*.pth`` it has just written from the same state_dict, instead of serialising,
  writing and fsyncing the same weights again (the library does this itself since commit
  e255145; the patch is kept to measure older versions and changes nothing on newer ones).
- ``durable``: only ``last.pth`` is fsynced; the weights-only files keep temp file + rename.
- ``async``: checkpoint files are written by a background thread from a copy of the tensors.
"""
import contextlib
import os
import statistics
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

import loop_contenders as lc
from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.losses_recorder import LossesRecorder, RunningSums
from basetrainer.engine import checkpoint
from basetrainer.metric.accuracy_recorder import AccuracyRecorder, ConfusionCounts
from basetrainer.scheduler.build_scheduler import LRSchedulerCallback


class DeferredCounts(ConfusionCounts):
    """ConfusionCounts that defers the confusion-matrix update to the next read."""

    def __init__(self, topk: Sequence[int]) -> None:
        self._pending: List[Any] = []
        self._matrix: Optional[torch.Tensor] = None
        self._classes = 0
        super().__init__(topk)

    @property
    def matrix(self) -> Optional[torch.Tensor]:  # type: ignore[override]
        self._fold()
        return self._matrix

    @matrix.setter
    def matrix(self, value: Optional[torch.Tensor]) -> None:
        self._matrix = value
        if value is None:
            self._pending = []

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        if len(self.topk) > 1 or outputs.dim() != 2 or targets.dim() != 1:
            return super().update(outputs, targets)
        self._classes = outputs.shape[1]
        self._pending.append((targets, outputs.detach().argmax(dim=1)))

    def _fold(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        c = self._classes
        targets = torch.cat([t for t, _ in pending]).to(dtype=torch.long)
        preds = torch.cat([p for _, p in pending]).to(targets.device)
        counts = torch.bincount(targets * c + preds, minlength=c * c)
        self._matrix = counts if self._matrix is None else self._matrix + counts


def _accuracy(cb: AccuracyRecorder) -> None:
    cb.train = DeferredCounts(cb.topk)


def _lr(cb: LRSchedulerCallback) -> None:
    def on_batch_prepare(epoch: int, batch: int, logs: Optional[dict] = None) -> None:
        step = epoch * cb.steps_per_epoch() + batch // cb._accumulate
        factor = cb.lr_factor(step)
        groups = cb.optimizer.param_groups
        for group, base in zip(groups, cb.scheduler.base_lrs):
            group["lr"] = base * factor
        cb.scheduler.last_epoch = step
        cb.scheduler._last_lr = [g["lr"] for g in groups]
        if logs is not None:
            logs["lr"] = groups[0]["lr"]
    cb.on_batch_prepare = on_batch_prepare


class InPlaceSums(RunningSums):
    """RunningSums adding each step's ``loss x n`` in place (one tensor op per figure)."""

    def add(self, values: Dict[str, torch.Tensor], n: int) -> None:
        for key, value in values.items():
            prev = self.sums.get(key)
            if prev is None:
                self.sums[key] = value.detach().float() * n
            else:
                prev.add_(value.detach(), alpha=n)
        self.count += n


def _loss(cb: LossesRecorder) -> None:
    cb.train = InPlaceSums()


CALLBACK_PATCHES: Dict[str, Any] = {"accuracy": (AccuracyRecorder, _accuracy), "lr": (LRSchedulerCallback, _lr),
                                    "loss": (LossesRecorder, _loss)}


@contextlib.contextmanager
def linked_best_file() -> Iterator[None]:
    """While active, ``checkpoint.atomic_save`` of the very object it saved last hard-links
    the file it wrote then (atomically: link to a temp name, rename)."""
    original = checkpoint.atomic_save
    last: Dict[str, Any] = {}

    def atomic_save(obj: Any, path: str) -> str:
        if last.get("obj") is obj and os.path.isfile(last["path"]):
            tmp = f"{path}.link{os.getpid()}"
            os.link(last["path"], tmp)
            os.replace(tmp, path)
            fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
            try:  # the rename is durable, as atomic_save makes it
                os.fsync(fd)
            finally:
                os.close(fd)
            return path
        original(obj, path)
        last.update(obj=obj, path=path)
        return path

    checkpoint.atomic_save = atomic_save
    try:
        yield
    finally:
        checkpoint.atomic_save = original


@contextlib.contextmanager
def durable_last_only() -> Iterator[None]:
    """While active, ``checkpoint.atomic_save`` fsyncs (file and folder) only ``last.pth``, the
    file a resume needs after a machine failure; the weights-only files keep the temp file +
    rename that makes them whole after any process crash, without waiting for the disk."""
    original = checkpoint.atomic_save

    def atomic_save(obj: Any, path: str) -> str:
        if os.path.basename(path) == "last.pth":
            return original(obj, path)
        tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp{os.getpid()}")
        try:
            torch.save(obj, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return path

    checkpoint.atomic_save = atomic_save
    try:
        yield
    finally:
        checkpoint.atomic_save = original


def _snapshot(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors no longer share memory with the live model/optimizer."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((k, _snapshot(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_snapshot(v) for v in obj)
    return obj


_PENDING_WRITES: List[Any] = []


def drain_writes() -> None:
    """Wait for every background checkpoint write (re-raising the first failure)."""
    pending, _PENDING_WRITES[:] = list(_PENDING_WRITES), []
    for future in pending:
        future.result()


class DrainWrites(Callback):
    """Waits for the background checkpoint writes when training ends (as a library version
    of ``async`` would, before ``on_train_end`` returns)."""

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        drain_writes()


@contextlib.contextmanager
def background_writes() -> Iterator[None]:
    """While active, ``checkpoint.atomic_save`` copies the tensors (so training can go on
    changing the originals) and leaves serialising, writing and fsyncing to one writer thread
    (files are written in order; :class:`DrainWrites` waits for them at the end of training)."""
    from concurrent.futures import ThreadPoolExecutor

    original = checkpoint.atomic_save
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")

    def atomic_save(obj: Any, path: str) -> str:
        _PENDING_WRITES.append(writer.submit(original, _snapshot(obj), path))
        return path

    checkpoint.atomic_save = atomic_save
    try:
        yield
    finally:
        checkpoint.atomic_save = original
        drain_writes()
        writer.shutdown()


CHECKPOINT_PATCHES: Dict[str, Callable[[], Any]] = {"checkpoint": linked_best_file, "durable": durable_last_only,
                                                    "async": background_writes}


def checkpoint_context(names: Sequence[str]) -> contextlib.ExitStack:
    """Enter the checkpoint-writing patches among ``names``."""
    stack = contextlib.ExitStack()
    for name in names:
        if name in CHECKPOINT_PATCHES:
            stack.enter_context(CHECKPOINT_PATCHES[name]())
    return stack


def applier(names: Sequence[str]) -> Callable[[Any], None]:
    """A ``patch`` for :func:`loop_contenders.run_basetrainer` applying the named callback patches."""
    def apply(bt: Any) -> None:
        if "async" in names:
            bt.callbacks.insert(0, DrainWrites())
        for cb in bt.callbacks:
            for name in names:
                kind, fn = CALLBACK_PATCHES.get(name, (None, None))
                if kind is not None and isinstance(cb, kind):
                    fn(cb)
    return apply


def what_if(spec: lc.Spec, patches: Sequence[str], repeats: int,
            say: Callable[[str], None] = lambda _m: None) -> Dict[str, Any]:
    """The cost per call of each callback handler, as is and with ``patches``, alternating.

    The handlers are timed one by one (loop_probes.callback_costs): a saving of tens of
    microseconds per step is far below the noise of a whole epoch on a shared machine, but
    stands out in the handler's own time.

    Returns:
        ``{"handlers": {"<Callback>.<event>": {"as_is_us", "patched_us", "calls_per_epoch"}},
        "weight_diff": ..., "loss_diff": ..., "patches": [...]}``; the differences are between
        the patched and the unpatched runs (the patches must not change training).
    """
    import loop_probes as probes

    dataset, state = lc.make_dataset(spec), lc.initial_state(spec)
    per_call: Dict[str, Dict[str, List[float]]] = {"as_is": {}, "patched": {}}
    calls: Dict[str, float] = {}
    last: Dict[str, lc.RunResult] = {}
    weight_diff, loss_diff = 0.0, 0.0
    for r in range(repeats):
        for label in ("as_is", "patched") if r % 2 == 0 else ("patched", "as_is"):
            chosen = patches if label == "patched" else ()
            apply = applier(chosen)

            def run(timing: Callable[[Any], None]) -> lc.RunResult:
                def both(bt: Any) -> None:
                    apply(bt)
                    timing(bt)
                with checkpoint_context(chosen):
                    return lc.run_basetrainer(spec, dataset, state, spec.epochs, "default", both)

            handlers, result = probes.callback_costs(run)
            last[label] = result
            for key, v in handlers.items():
                per_call[label].setdefault(key, []).append(v["total_s"] / max(v["calls"], 1) * 1e6)
                calls[key] = v["calls"] / spec.epochs
        weight_diff = max(weight_diff, lc.max_weight_diff(last["as_is"].weights, last["patched"].weights))
        loss_diff = max(loss_diff, lc.max_loss_diff(last["as_is"].losses, last["patched"].losses))
        say(f"    repeat {r + 1}/{repeats}: epoch {last['as_is'].run_epoch_s * 1e3:.1f} ms as is, "
            f"{last['patched'].run_epoch_s * 1e3:.1f} ms patched")
    handlers = {}
    for key in per_call["as_is"]:
        if key in per_call["patched"]:
            handlers[key] = {"as_is_us": statistics.median(per_call["as_is"][key]),
                             "patched_us": statistics.median(per_call["patched"][key]),
                             "calls_per_epoch": calls[key]}
    return {"handlers": handlers, "weight_diff": weight_diff, "loss_diff": loss_diff, "patches": list(patches)}


def epoch_what_if(spec: lc.Spec, variants: Dict[str, Sequence[str]], repeats: int,
                  say: Callable[[str], None] = lambda _m: None) -> Dict[str, Any]:
    """Whole-epoch times of basetrainer with each set of patches, and of the hand loop.

    The variants and the hand loop (``"hand"``) alternate, in reverse order every other
    round; an untimed first round warms up. Every variant's final weights must equal the
    unpatched run's.

    Returns:
        ``{"runs": {variant: [epoch s per run]}, "weight_diff": max over variants}``.
    """
    dataset, state = lc.make_dataset(spec), lc.initial_state(spec)
    names = list(variants) + ["hand"]
    runs: Dict[str, List[float]] = {n: [] for n in names}
    reference: Optional[lc.RunResult] = None
    weight_diff = 0.0
    for r in range(repeats + 1):
        for name in names if r % 2 == 0 else names[::-1]:
            if name == "hand":
                result = lc.run_hand(spec, dataset, state, spec.epochs, track_loss=True)
            else:
                with checkpoint_context(variants[name]):
                    result = lc.run_basetrainer(spec, dataset, state, spec.epochs, "default",
                                                applier(variants[name]))
                reference = reference or result
                weight_diff = max(weight_diff, lc.max_weight_diff(reference.weights, result.weights))
            if r:
                runs[name].append(result.run_epoch_s)
        if r:
            say(f"    repeat {r}/{repeats}: " + ", ".join(f"{n} {runs[n][-1] * 1e3:.0f}" for n in names) + " ms/epoch")
    return {"runs": runs, "weight_diff": weight_diff}
