"""The :class:`Callback` base class: the events of the loop, in the order the engine calls them,
and what a callback declares to the run (its state, its files); and :class:`CallbackList`, the one
dispatcher of those events."""
import difflib
import inspect
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from basetrainer.runtime.watchdog import PROGRESS

_logger = logging.getLogger(__name__)

EVENTS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_batch_prepare",
          "on_batch_begin", "on_batch_end", "on_train_summary", "on_test_begin", "on_test_summary",
          "on_test_end", "on_predict_begin", "on_predict_end")


class Callback:
    """Base class of everything that watches or steers training.

    The engine calls the events below, in this order, on every callback in list order::

        on_train_begin(logs)
        for epoch in range(start_epoch, num_epochs):
            on_epoch_begin(epoch, logs)                 # after sampler.set_epoch(epoch)
            for batch, data in enumerate(train_loader):
                on_batch_prepare(epoch, batch, logs)    # LR schedules set this step's LR here
                on_batch_begin(batch, logs)
                outputs, losses = run_step(data)        # forward (+ autocast); backward; step
                on_train_summary(data, outputs, losses, epoch, batch, logs)
                on_batch_end(batch, logs)
            on_test_begin(logs)                         # train figures are final from here on
            for batch, data in enumerate(test_loader):  # (skipped when there is no test loader)
                on_test_summary(data, outputs, losses, epoch, batch, logs)
            on_test_end(logs)                           # test figures are final from here on
            on_epoch_end(epoch, logs)                   # every figure is final and reduced
        on_train_end(logs)                              # always, also after an exception

    ``logs`` is one flat dict per run: recorders write ``"train/<indicator>"`` and
    ``"test/<indicator>"``, the LR schedule writes ``"lr"``. ``self.trainer`` is the engine
    (set before ``on_train_begin``); ``self.model`` its model. A callback may set
    ``self.trainer.stop_training = True`` to end training after the current epoch.

    The signatures are those of Pytorch-Base-Trainer, so callbacks written for it keep working.

    What a callback holds and owns is declared by the methods below (each with a neutral
    default, so a callback with no state needs none of them): :attr:`state_key`,
    :meth:`state_dict`, :meth:`load_state_dict` and :meth:`prepare_state` (its part of a
    resumable checkpoint); :meth:`last_checkpoint_dir`, :meth:`run_folders` and
    :meth:`run_files` (the folders and files it writes, which a new run must not write over);
    :meth:`test_weights` and :meth:`mode_of` (what it tells the callbacks beside it). The engine
    never looks for other names: a method whose name is close to one of these (``state_dic``)
    is named in a warning when the run starts.

    Example::

        class LogLR(Callback):
            def on_epoch_end(self, epoch, logs=None):
                logging.getLogger(__name__).info("%d %s %s", epoch, logs["lr"], logs.get("test/Accuracy"))
    """

    trainer: Any = None
    model: Optional[torch.nn.Module] = None

    def __init__(self) -> None:
        self.trainer = None
        self.model = None

    @property
    def is_main_process(self) -> bool:
        """True in the process that writes files and logs (rank 0); may be assigned."""
        override = self.__dict__.get("_is_main_process")
        if override is not None:
            return override
        from basetrainer.runtime import comm

        return comm.is_main_process()

    @is_main_process.setter
    def is_main_process(self, value: bool) -> None:
        self.__dict__["_is_main_process"] = bool(value)

    def set_trainer(self, trainer: Any) -> None:
        self.trainer = trainer
        if getattr(trainer, "model", None) is not None:
            self.set_model(trainer.model)

    def set_model(self, model: torch.nn.Module) -> None:
        self.model = model

    @property
    def state_key(self) -> str:
        """The name of this callback's state in a checkpoint: its class name by default;
        callbacks of which a trainer may hold several add what tells them apart (e.g.
        ModelCheckpoint's folder and indicator). Override it to keep a state across a rename."""
        return type(self).__name__

    def state_dict(self) -> Dict[str, Any]:
        """State to save in a resumable checkpoint (tensors, numbers, strings, lists, dicts),
        restored by :meth:`load_state_dict` on resume, matched by :attr:`state_key`."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def prepare_state(self) -> None:
        """Called on every rank just before a checkpoint reads :meth:`state_dict` (the main
        process's): the place for collectives, e.g. summing per-rank partial figures."""

    def last_checkpoint_dir(self) -> Optional[str]:
        """The folder where this callback wants the run's resumable ``last.pth`` (ModelCheckpoint:
        its ``model_dir``); None (the default): it keeps no checkpoints."""
        return None

    def run_folders(self) -> List[str]:
        """The folders this callback writes the run's files to: checked writable, and cleared of
        killed writes' temp files, when a run starts."""
        return []

    def run_files(self) -> List[str]:
        """The files of an earlier run in :meth:`run_folders` that this callback would write
        over (a new run there is refused, or moves them aside with ``overwrite``)."""
        return []

    def test_weights(self) -> Optional[Dict[str, torch.Tensor]]:
        """The weights the test phase runs on when this callback swaps others in for it
        (ModelEMA's average), so that weights files hold what gave a test figure; None: the live
        weights. Every rank calls it."""
        return None

    def mode_of(self, key: str) -> Optional[str]:
        """``"max"``/``"min"`` for the figure ``logs[key]`` when this callback writes it and
        knows which way is better; None otherwise."""
        return None

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        pass

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        pass

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        pass

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        pass

    def on_batch_prepare(self, epoch: int, batch: int, logs: Optional[dict] = None) -> None:
        pass

    def on_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        pass

    def on_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        pass

    def on_train_summary(self, inputs: Any, outputs: Any, losses: Any, epoch: int, batch: int,
                         logs: Optional[dict] = None) -> None:
        pass

    def on_test_begin(self, logs: Optional[dict] = None) -> None:
        pass

    def on_test_summary(self, inputs: Any, outputs: Any, losses: Any, epoch: int, batch: int,
                        logs: Optional[dict] = None) -> None:
        pass

    def on_test_end(self, logs: Optional[dict] = None) -> None:
        pass

    def on_predict_begin(self, logs: Optional[dict] = None) -> None:
        """``predict()`` begins (after ``checkpoint=`` is loaded): e.g. ModelEMA swaps in the
        weights the test phase runs on, so predictions are of the weights evaluate() tests."""

    def on_predict_end(self, logs: Optional[dict] = None) -> None:
        """``predict()`` ends, also when it raises."""


class CallbackList:
    """The callbacks of one run, bound to the trainer, and the one dispatcher of the events.

    Args:
        callbacks: the callbacks, in the order they are called (None entries are skipped).
        trainer: given to each callback (``set_trainer``, or ``set_model`` for callbacks that
            only know the model).
    """

    def __init__(self, callbacks: Sequence[Any], trainer: Any) -> None:
        self.callbacks = checked([c for c in callbacks if c is not None])
        for cb in self.callbacks:
            cb.set_trainer(trainer)
        # per event, only the callbacks that implement it (an empty base method costs a call), with
        # the label the stall watchdog reports while it runs
        self.handlers: Dict[str, List[Tuple[str, Any, str]]] = {}
        for event in EVENTS:
            base = getattr(Callback, event)
            self.handlers[event] = [(type(cb).__name__, getattr(cb, event), f"callback {type(cb).__name__}.{event}")
                                    for cb in self.callbacks if getattr(type(cb), event) is not base]

    def call(self, event: str, *args: Any) -> None:
        """Call ``event`` on every callback in list order; a failure names the callback. While a
        callback runs, the stall watchdog's progress stamp names it (two attribute writes)."""
        progress = PROGRESS
        for name, handler, label in self.handlers.get(event, ()):
            progress.where = label
            try:
                handler(*args)
            except Exception as e:
                if hasattr(e, "add_note"):  # Python 3.11+
                    e.add_note(f"raised in callback {name}.{event}")
                raise
            finally:
                progress.where = ""

    def call_all(self, event: str, *args: Any, raise_first: bool = True) -> None:
        """Call ``event`` on every callback even when some fail: the first error is raised
        after all ran (``raise_first=False``: every error is logged instead, e.g. when another
        error is already on its way)."""
        first: Optional[BaseException] = None
        progress = PROGRESS
        for name, handler, label in self.handlers.get(event, ()):
            progress.where = label
            try:
                handler(*args)
            except Exception as e:
                if raise_first and first is None:
                    if hasattr(e, "add_note"):
                        e.add_note(f"raised in callback {name}.{event}")
                    first = e
                else:  # one line: the error on its way is the one to read
                    _logger.error("%s.%s failed too: %s: %s", name, event, type(e).__name__, e)
        progress.where = ""
        if first is not None:
            raise first


# what a callback declares (a method of a subclass named close to one of these is a misspelling)
DECLARED = EVENTS + ("state_key", "state_dict", "load_state_dict", "prepare_state", "last_checkpoint_dir",
                     "run_folders", "run_files", "test_weights", "mode_of", "set_trainer", "set_model")


def checked(callbacks: List[Any]) -> List["Callback"]:
    """``callbacks``, each a :class:`Callback`; a method named close to one the engine calls
    (``state_dic``, ``on_epoch_ends``) is named in a warning, once per class and list: the engine
    calls only the declared names, so that method would never run (its state never saved). A
    warning, not an error: a helper method may have such a name on purpose, and callbacks written
    for the original API must keep running.

    Raises:
        TypeError: an entry that is not a :class:`Callback`; a ``state_key`` defined as a plain
            method (its checkpoint name would be the bound method's text, with an address that
            differs in every process: the state would never be restored).
    """
    seen = set()
    for i, cb in enumerate(callbacks):
        if not isinstance(cb, Callback):
            raise TypeError(f"callbacks[{i}] is a {type(cb).__name__}, not a Callback: subclass "
                            f"basetrainer.Callback (from basetrainer.callbacks.callbacks import Callback); it "
                            f"declares every event and the state a checkpoint saves, with neutral defaults")
        if callable(inspect.getattr_static(type(cb), "state_key")):
            raise TypeError(f"callbacks[{i}]: {type(cb).__name__}.state_key is a method, so its state would be "
                            f"saved under the method's text (an address, new in every run) and never restored: "
                            f"put @property above 'def state_key(self)', or set state_key = '...' on the class")
        if type(cb) not in seen:
            seen.add(type(cb))
            for name, meant in misspellings(type(cb)):
                _logger.warning("callback %s defines %s(), which the engine never calls: did you mean %s()? "
                                "(%s is the name the engine uses)", type(cb).__name__, name, meant, meant)
    return callbacks


def misspellings(kind: type) -> List[Tuple[str, str]]:
    """``(name, declared name)`` for each public name a Callback subclass defines that is close
    to, but not, a name the engine calls (``state_dic`` -> ``state_dict``)."""
    names = sorted({n for klass in kind.__mro__ if klass is not Callback and klass is not object
                    for n in vars(klass) if not n.startswith("_") and n not in DECLARED})
    out = []
    for name in names:
        close = difflib.get_close_matches(name, DECLARED, n=1, cutoff=0.8)
        if close:
            out.append((name, close[0]))
    return out


def resolve_indicator(indicator: str, trainer: Any) -> str:
    """The ``logs`` key an indicator names.

    ``"test/Accuracy"`` and ``"lr"``-style keys are returned as given. A bare name
    (``"Accuracy"``) means the test figure when the trainer has a test loader, else the train
    figure.
    """
    if "/" in indicator or indicator == "lr":
        return indicator
    has_test = trainer is not None and getattr(trainer, "test_loader", None) is not None
    return f"{'test' if has_test else 'train'}/{indicator}"


def infer_mode(indicator: str) -> str:
    """``"min"`` for losses and errors, ``"max"`` for everything else (accuracy, F1, mAP, ...)."""
    name = indicator.lower()
    return "min" if any(word in name for word in ("loss", "err", "mse", "mae", "perplexity")) else "max"


def mode_of_indicator(indicator: str, trainer: Any) -> Optional[str]:
    """``"max"``/``"min"`` as told by the callback that writes ``indicator``'s figure: the first
    of the trainer's callbacks whose ``mode_of(key)`` answers (e.g. a MetricRecorder, from its
    metric's ``higher_is_better``); None when none does (the caller falls back to the name)."""
    if not indicator or trainer is None:
        return None
    key = resolve_indicator(indicator, trainer)
    for cb in getattr(trainer, "callbacks", None) or []:   # (a trainer's field, not a callback's)
        mode = cb.mode_of(key) if cb is not None else None
        if mode in ("max", "min"):
            return mode
    return None


def batch_size_of(inputs: Any) -> int:
    """Number of samples in a batch.

    A tensor counts its first dimension. A list or tuple holds the batch's parts (inputs,
    targets, ...) and a dict its values: the count is the one the parts agree on. A part that is
    itself a list or tuple is either per-sample items (the images and target dicts of a detection
    batch: it counts its length) or batched parts (the inputs of a multi-input model: they count
    their first dimension); the other parts tell which. Where they agree on nothing, the first
    part decides. (A bare list of images cannot be told from a list of parts, so it is read as
    parts: put it in a batch, ``(images, targets)``.)

    Raises:
        TypeError: no tensor anywhere in the batch.
    """
    if isinstance(inputs, torch.Tensor):
        return int(inputs.shape[0]) if inputs.dim() else 1
    if type(inputs) is tuple or type(inputs) is list:   # the common (inputs, targets) batch: one look
        n = _same_first_dim(inputs)
        if n is not None:
            return n
    parts = list(inputs.values()) if isinstance(inputs, dict) else inputs
    if isinstance(parts, (list, tuple)) and _has_tensor(parts):
        options = [_counts(part) for part in parts]
        agreed = _agreed(options)
        return agreed[0] if agreed else next(o[0] for o in options if o)
    raise TypeError(f"cannot find a tensor in the batch to count its samples (got {type(inputs).__name__})")


def _same_first_dim(parts: Sequence[Any]) -> Optional[int]:
    """The first dimension all ``parts`` share when every one is a tensor of at least one
    dimension (what :func:`batch_size_of` would find the long way), else None."""
    n = None
    for part in parts:
        if not isinstance(part, torch.Tensor) or part.dim() == 0:
            return None
        m = part.shape[0]
        if n is None:
            n = m
        elif m != n:
            return None
    return None if n is None else int(n)


def _has_tensor(item: Any) -> bool:
    if isinstance(item, torch.Tensor):
        return True
    values = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else ()
    return any(_has_tensor(v) for v in values)


def _counts(part: Any) -> List[int]:
    """The sample counts ``part`` may stand for, the likelier first (none for a plain value)."""
    if isinstance(part, torch.Tensor):
        return [int(part.shape[0]) if part.dim() else 1]
    if isinstance(part, dict):
        part = list(part.values())
    if not isinstance(part, (list, tuple)) or not part:
        return []
    as_parts = _agreed([_counts(p) for p in part])  # batched parts share their first dimension
    return [len(part)] + [n for n in as_parts if n != len(part)]


def _agreed(options: Sequence[List[int]]) -> List[int]:
    """The counts every informative option allows, in the first one's order."""
    informative = [o for o in options if o]
    if not informative:
        return []
    return [n for n in informative[0] if all(n in o for o in informative[1:])]


def pick_output(outputs: Any, output_key: Optional[str] = None, who: str = "the recorder",
                fix: Optional[str] = None) -> Any:
    """The tensor a recorder reads from a model's outputs, by one rule for every recorder (and
    EvalReport): ``outputs[output_key]`` when ``output_key`` is given (dict outputs); a tensor as
    it is; of a tuple or list, its first entry (by this rule again: a dict there too); of a
    dict, its ``"logits"`` entry, else its ``"out"`` entry (torchvision's segmentation models return ``{"out", "aux"}``), else its only
    entry.

    Raises:
        ValueError: a dict of several entries, none of them ``"logits"`` or ``"out"``: which one
            is the prediction cannot be told (``who`` and ``fix`` name the recorder and its fix,
            default ``output_key=``).
        KeyError: ``output_key`` is not in the dict. TypeError: ``output_key`` for outputs with
            no dict (first entries followed).
    """
    if isinstance(outputs, dict):
        if output_key is not None:
            if output_key not in outputs:
                raise KeyError(f"{who}: output_key={output_key!r} is not in the model's outputs (keys: "
                               f"{sorted(outputs)}); set output_key to one of them")
            return outputs[output_key]
        for key in ("logits", "out"):
            if key in outputs:
                return outputs[key]
        if len(outputs) == 1:
            return next(iter(outputs.values()))
        fix = fix or f"give output_key= the key of the predictions (e.g. output_key={next(iter(outputs))!r})"
        raise ValueError(f"{who}: the model's outputs are a dict of {sorted(outputs)}, with no 'logits' or 'out' "
                         f"entry to read by default: {fix}")
    if isinstance(outputs, (list, tuple)) and outputs:   # ({"logits": ..}, aux): the rule goes on in the first
        return pick_output(outputs[0], output_key, who, fix)
    if output_key is not None:
        raise TypeError(f"{who}: output_key={output_key!r} needs dict outputs, but the model returned a "
                        f"{type(outputs).__name__}; leave output_key out")
    return outputs


def targets_of(inputs: Any) -> torch.Tensor:
    """The targets of a ``(data, targets, ...)`` batch, or ``inputs["target(s)"|"label(s)"]``."""
    if isinstance(inputs, dict):
        for key in ("targets", "target", "labels", "label"):
            if key in inputs:
                return inputs[key]
        raise KeyError(f"batch dict has no targets: expected one of targets/target/labels/label, got {sorted(inputs)}")
    if isinstance(inputs, (list, tuple)) and len(inputs) >= 2:
        return inputs[1]
    raise TypeError("a recorder needs batches shaped (data, targets, ...); override run_step or the recorder")
