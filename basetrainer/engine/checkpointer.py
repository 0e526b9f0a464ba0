"""The engine's checkpointer (``engine.checkpointer``): where the run is, saving that point, and
starting from a saved one.

It owns the position (``epoch``, ``phase`` train | test | end, ``batch_in_epoch``, ``global_step``),
which the loop moves on; the saves (asked for the epoch's end, written now, or waiting for the end
of an accumulation window); the start point of a run (``start_epoch``, the batches of it already
trained, the phase it starts at), computed from a position by one function
(:meth:`Checkpointer.start_after`); a loaded checkpoint's random generators, put back when
the run reaches its point; and the run's registry of stateful objects
(:meth:`Checkpointer.registry`, see :mod:`basetrainer.engine.registry`), which a save and a
resume each pass over once. Which checkpoint a run continues from is decided by
:mod:`basetrainer.engine.resume` (a :class:`~basetrainer.engine.resume.Start`); how checkpoint
files are written, found and loaded is :mod:`basetrainer.runtime.checkpoint`.
"""
import contextlib
import operator
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from basetrainer.dataloader import loader as loaders
from basetrainer.engine.guard import NonFiniteGuard
from basetrainer.engine.registry import CallbackStates, Fields, RandomState, Registry, Value, Weights
from basetrainer.runtime import atomic, checkpoint, comm, sharded, sharding
from basetrainer.runtime.watchdog import PROGRESS


POSITION = ("run_id", "epoch", "phase", "epoch_complete", "batch", "global_step", "logs")   # a checkpoint's keys


def delegated(name: str, settable: bool = False) -> property:
    """A property of the engine that is ``engine.checkpointer.<name>`` (its getter is C code, so a
    callback reading ``trainer.global_step`` every step adds no Python call)."""
    def set_value(engine: Any, value: Any) -> None:
        setattr(engine.checkpointer, name, value)

    return property(operator.attrgetter(f"checkpointer.{name}"), set_value if settable else None,
                    doc=f"``self.checkpointer.{name}`` (see :class:`Checkpointer`).")


# the engine's attributes that are its checkpointer's (name on the engine: name here, settable)
POSITION = {"epoch": ("epoch", True), "phase": ("phase", True),   # phase: train | test | end
            "batch_in_epoch": ("batch_in_epoch", True),            # train steps done in the epoch
            "global_step": ("global_step", True),                  # optimizer steps taken so far
            "start_epoch": ("start_epoch", True),                  # where the next run() starts
            "run_id": ("run_id", True), "epoch_complete": ("epoch_complete", False),
            "checkpoint_folder": ("folder", False), "request_checkpoint": ("request", False),
            "request_step_checkpoint": ("request_step", False),
            "state_dict": ("state_dict", False), "load_state_dict": ("load", False)}


def with_position(cls: type) -> type:
    """Give the engine class the :data:`POSITION` attributes: where the run is and its
    checkpoints, read and written through the engine by the names callbacks use."""
    for name, (attr, settable) in POSITION.items():
        setattr(cls, name, delegated(attr, settable=settable))
    return cls


class Checkpointer:
    """Saves and restores the run of ``engine`` (see the module's docstring).

    Args:
        engine: the engine whose state it saves (model, optimizer, scaler, callbacks, config, logs).
        guard: the engine's non-finite loss guard: no state is saved after a bad loss.
    """

    def __init__(self, engine: Any, guard: NonFiniteGuard) -> None:
        self.engine, self.guard = engine, guard
        self.epoch, self.phase, self.batch_in_epoch, self.global_step = 0, "train", 0, 0
        self.in_test_phase = False   # inside run()'s test phase (evaluate() and predict() are refused there)
        self.running = False         # inside run()
        self.start_epoch, self.skip_batches, self.start_phase = 0, 0, "train"
        self.run_id: Optional[str] = None
        self.restored_logs: Dict[str, Any] = {}   # the loaded checkpoint's figures (the next run's logs)
        self.asked: Optional[bool] = None         # a save asked for the epoch's end (in the background?)
        self.deferred: Optional[bool] = None      # a save asked inside an accumulation window (background?)
        self._saved_at: Optional[tuple] = None    # the position last.pth holds
        self._pending_rng: Optional[dict] = None  # a loaded checkpoint's generators, until its point
        self._chosen: Optional[str] = None        # the checkpoint folder of the running run
        self._folder: Optional[checkpoint.CheckpointFolder] = None

    # ----------------------------------------------------------------------------- the folder
    def candidates(self) -> List[str]:
        """Where ``last.pth`` may go: the folder each callback declares for it
        (``last_checkpoint_dir``: every ModelCheckpoint's), in list order, then ``<work_dir>/model``."""
        engine = self.engine
        found = [c.last_checkpoint_dir() for c in self.callbacks() if c.last_checkpoint_dir()]
        work_dir = getattr(engine.cfg, "get", lambda *_: None)("work_dir")
        found += [os.path.join(work_dir, "model")] if work_dir else []
        return list(dict.fromkeys(found))

    def directory(self) -> Optional[str]:
        """The folder of ``last.pth``: the one chosen when the run started (the candidate that
        already holds this run's checkpoints, else the first), else the first candidate, else
        None (no resumable checkpoints)."""
        if self._chosen is not None:
            return self._chosen
        candidates = self.candidates()
        return candidates[0] if candidates else None

    def folder(self, path: Optional[str] = None) -> Optional[checkpoint.CheckpointFolder]:
        """The :class:`~basetrainer.runtime.checkpoint.CheckpointFolder` of ``path`` (default:
        :meth:`directory`), the same object while the folder stays: it remembers what it saved
        and a damaged ``last.pth`` it found."""
        path = path or self.directory()
        if path and (self._folder is None or self._folder.folder != path):
            self._folder = checkpoint.CheckpointFolder(path)
        return self._folder if path else None

    # ----------------------------------------------------------------------------- saving
    def request(self, background: bool = True) -> None:
        """Ask for ``last.pth`` at the end of this epoch, after every ``on_epoch_end`` (every
        rank asks; ModelCheckpoint does)."""
        self.asked = background if self.asked is None else (self.asked and background)

    def request_step(self, background: bool = True) -> None:
        """Ask for ``last.pth`` after this train step, once every ``on_batch_end`` has run (the
        callbacks after the asker have then counted this step too); inside an accumulation
        window, at its end (every rank asks; ModelCheckpoint's ``save_freq_steps`` does)."""
        self.deferred = background if self.deferred is None else (self.deferred and background)

    def save(self, path: Optional[str] = None, background: bool = False, in_window: bool = False) -> Optional[str]:
        """Write a resumable checkpoint of this point (every rank calls it: it gathers every
        rank's RNG state; the main process writes). A second save at the same point writes
        nothing. Returns the path (None without a checkpoint folder, or when the save waits).

        Called (without ``path``) from a callback's ``on_batch_end``, it waits for the step's
        end, as :meth:`request_step`: the callbacks after the caller count the step first.

        Args:
            path: default ``<directory()>/last.pth`` (then the files callbacks staged are
                written first, and the previous ``last.pth`` is kept as ``last.prev.pth``).
            background: copy the state and write it in the background writer thread.
            in_window: the train phase is inside an accumulation window: the save waits for
                the window's end (the accumulated gradients are not saved).

        Raises:
            FloatingPointError: a loss since the last check, or a weight, is not finite.
        """
        self.guard.check(self.epoch)   # never save the state after a non-finite loss
        folder = self.folder()
        if path is None and folder is None:
            return None
        if path is None and self.phase == "train" and PROGRESS.where.endswith(".on_batch_end"):
            self.request_step(background)   # from a callback's on_batch_end: after all of them (see request_step)
            return None
        if in_window and self.phase == "train":
            self.deferred = background if self.deferred is None else (self.deferred and background)
            return None
        self.deferred = None
        at = (self.epoch, self.phase, self.batch_in_epoch, self.global_step)
        if path is None and at == self._saved_at:
            if not background:
                atomic.wait_for_writes()
            return folder.last
        engine = self.engine
        states = self.registry()
        states.prepare()   # every rank: callbacks reduce per-rank state, every rank's RNGs are gathered
        target = folder if path is None else checkpoint.CheckpointFolder(os.path.dirname(os.path.abspath(path)))
        if sharding.is_fsdp(engine.model):   # every rank writes its shards (in the foreground)
            sharded.save(engine, target, states.state_dict(), path)
        elif comm.is_main_process():
            target.commit(states.state_dict(), background=background, path=path)
        if path is None:
            self._saved_at = at
        comm.synchronize()
        return path or folder.last

    def epoch_plan(self) -> Dict[str, Any]:
        """What lays out the batches of the epoch in progress (``loader.epoch_plan``), for a
        checkpoint taken inside its train phase: a resume there must find the same. ``{}``
        elsewhere, or for a train loader not made by ``build_dataloader``."""
        if self.phase != "train" or not self.batch_in_epoch:
            return {}
        return loaders.epoch_plan(self.engine.train_loader, self.epoch)

    def state_dict(self) -> dict:
        """Everything a resume needs, at this point (this process's RNGs; live tensors: copy
        them with :func:`basetrainer.runtime.atomic.snapshot` before training goes on)."""
        return self.registry().state_dict()

    def callbacks(self) -> List[Any]:
        """The engine's callbacks (the user's list, without empty entries)."""
        return [cb for cb in self.engine.callbacks or [] if cb is not None]

    def registry(self) -> Registry:
        """The run's stateful objects under stable names (see :mod:`basetrainer.engine.registry`),
        in the order they are saved and restored: a save is one pass over it, a resume one."""
        engine = self.engine
        scaler = engine.scaler
        return Registry({
            "format": Value("format", lambda: checkpoint.FORMAT),
            "position": Fields(POSITION, self._position, self._go_to),   # where the run is, its figures there
            "sampler": Value("epoch_plan", self.epoch_plan),   # the epoch's batches (resume.py checks them)
            "model": Weights(engine),   # and the optimizer
            "scaler": Value("scaler", lambda: scaler.state_dict() if scaler is not None else {},
                            scaler.load_state_dict if scaler is not None else None),
            "callbacks": CallbackStates(self.callbacks()),
            "rng": RandomState(checkpoint.rng_state, self._set_pending_rng),
            "world": Value("world_size", lambda: int(getattr(engine, "world_size", 1) or 1)),
            "config": Value("config", lambda: checkpoint.plain(dict(engine.cfg)) if engine.cfg is not None else {}),
            "stopped": Value("stopped", lambda: bool(engine.stop_training)),   # e.g. EarlyStopping ended the run
        })

    def _position(self) -> Dict[str, Any]:
        return {"run_id": self.run_id, "epoch": int(self.epoch),
                "phase": self.phase,   # train (inside the epoch) | test | end
                "epoch_complete": self.phase == "end", "batch": int(self.batch_in_epoch),
                "global_step": int(self.global_step),
                "logs": {k: v for k, v in self.engine.logs.items() if isinstance(v, (int, float))
                         and not isinstance(v, bool)}}

    def _go_to(self, state: dict, source: str) -> None:
        position = checkpoint.position(state)
        self.start_after(*position)
        self.global_step = int(state.get("global_step", 0))
        self.restored_logs = dict(state.get("logs") or {})
        self.run_id = state.get("run_id") or self.run_id
        self._saved_at = (*position, self.global_step)

    def _set_pending_rng(self, state: dict) -> None:
        self._pending_rng = state

    # ----------------------------------------------------------------------------- restoring
    def load(self, state: dict, source: str = "checkpoint") -> Tuple[int, str, int]:
        """Restore :meth:`state_dict` into the engine: training continues after the saved point
        (inside the epoch, skipping the batches already trained, for a mid-epoch checkpoint).

        Args:
            state: a checkpoint (a sharded one reads its shards beside ``source``).
            source: the file it was loaded from (errors name it).

        Returns:
            The position it was saved at: ``(epoch, phase, batch)``.
        """
        if state.get("shards"):   # a sharded checkpoint: read (and reshard) the tensors it refers to
            state = sharded.load(state, os.path.dirname(os.path.abspath(source)),
                                 sharding.mesh_of(self.engine.unwrapped_model))
        self.registry().load_state_dict(state, source)
        return checkpoint.position(state)

    def start(self, plan: Any) -> None:
        """Start a run as :mod:`basetrainer.engine.resume` decided (its ``Start``): in its folder,
        from its checkpoint (or, for ``run()`` again, from where the last run ended). Every
        callback's ``state_key`` is read first: a clash or a failing key is found before training."""
        CallbackStates(self.callbacks()).keyed()
        self._chosen = plan.folder
        if plan.again:
            self.start_after(self.epoch, self.phase, self.batch_in_epoch)
            return
        if plan.state is not None:
            self.load(plan.state, source=plan.path or "checkpoint")
            if plan.stopped:   # e.g. EarlyStopping ended it: a resume does not train on
                self.start_epoch = max(self.start_epoch, int(self.engine.num_epochs))
        self.run_id = plan.run_id

    def start_after(self, epoch: int, phase: str, batch: int) -> None:
        """Set the start point of the next run to just after the position ``(epoch, phase,
        batch)``: the next epoch after an epoch's end, its test phase after its train phase,
        else its train phase after ``batch`` steps."""
        self.start_epoch = epoch + 1 if phase == "end" else epoch
        self.skip_batches = batch if phase == "train" else 0
        self.batch_in_epoch = 0 if phase == "end" else batch   # train steps of start_epoch already done
        self.start_phase = "test" if phase == "test" else "train"

    # ----------------------------------------------------------------------------- the loop's moves
    def enter_epoch(self, epoch: int) -> bool:
        """The loop begins ``epoch``; False when its train phase is skipped (a run that starts
        at the test phase of its first epoch)."""
        self.epoch = epoch
        at_test, self.start_phase = self.start_phase == "test", "train"
        return not at_test

    def enter_train(self, loader: Any, open_loader: Callable[[Any], Iterator[Any]]) -> Tuple[int, Iterator[Any]]:
        """The train phase begins: ``(first batch index, the loader's iterator at it)``.

        At a mid-epoch start point the batches trained before the stop are not trained again:
        the batch sampler starts late where it can (no batch before the stop is loaded), else
        they are drawn and dropped. The random generators are put back as they were at the
        saved point before the first batch is made.
        """
        self.phase = "train"
        skip, self.skip_batches = self.skip_batches, 0
        self.batch_in_epoch = skip
        sampler = getattr(loader, "batch_sampler", None)
        drop = skip
        if skip and hasattr(sampler, "start_at"):
            sampler.start_at(skip)
            drop = 0
        if not drop:
            self._restore_rng()
        batches = open_loader(loader)
        if drop and sum(1 for _ in zip(range(drop), batches)) == drop:
            self._restore_rng()   # generators as at the stop, before the next batch is made
        return skip, batches

    @contextlib.contextmanager
    def in_run(self) -> Iterator[None]:
        """The ``with`` body is ``run()``: :attr:`running` is True in it (evaluate() and predict()
        called from a callback put back the weights a ``checkpoint=`` replaced)."""
        self.running = True
        try:
            yield
        finally:
            self.running = False

    @contextlib.contextmanager
    def test_phase(self) -> Iterator[None]:
        """The ``with`` body is the test phase (the generators are put back first if the run
        starts here); :attr:`in_test_phase` is True in it, until it ends or raises."""
        self._restore_rng()
        self.phase, self.in_test_phase = "test", True
        try:
            yield
        finally:
            self.in_test_phase = False

    def end_epoch(self) -> None:
        """The epoch has ended (after every ``on_epoch_end``): write the checkpoint asked for."""
        self.phase = "end"
        if self.asked is not None:
            background, self.asked = self.asked, None
            self.save(background=background)

    @property
    def epoch_complete(self) -> bool:
        """The current epoch has ended (its figures are final)."""
        return self.phase == "end"

    def _restore_rng(self) -> None:
        """Put a loaded checkpoint's random generators back (once)."""
        if self._pending_rng is not None:
            checkpoint.set_rng_state(self._pending_rng)
            self._pending_rng = None
