"""Starting a run: continue the run in its folder (``resume``), start a new one, or refuse.

- ``resume: auto`` continues from the newest loadable checkpoint of this run's checkpoint
  folder (``last.pth``, else ``last.prev.pth``, saying so); when checkpoints exist but none
  loads, it stops with an error naming them rather than training from scratch over the run.
- A new run (no ``resume``) in a folder holding another run's files is refused;
  ``overwrite: true`` moves the old run aside (``<folder>.old-<time>``) first.
- On resume, a changed config is reported key by key. Keys that shape what comes next (lr,
  num_epochs, log_freq, ...) take the new value; a change that makes the run no continuation
  (model, input size, data, seed) is refused, naming the key. So is, for a checkpoint taken
  inside an epoch, anything that lays out that epoch's batches otherwise (``batch_size``,
  ``accumulate_steps``, and what draws its order: ``balance``, ``shuffle``, the training set),
  told by the epoch's plan saved with it (``loader.epoch_plan``): the steps after the stop would
  come from another order than those before it.

The main process decides (it alone touches files); every rank receives the decision (a
:class:`Start`) and hands it to its engine's checkpointer, which
loads the checkpoint and sets the position the run starts from. So all ranks continue, or all
raise the same error.
"""
import builtins
import dataclasses
import logging
import os
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from basetrainer.dataloader import loader as loaders
from basetrainer.runtime import atomic, checkpoint, comm, run_folder
from basetrainer.runtime.errors import ConfigError, UsageError

logger = logging.getLogger(__name__)

# config key -> the optimizer hyper-parameters built from it
_OPTIMIZER_KEYS = {"lr": ("lr", "initial_lr"), "momentum": ("momentum",), "weight_decay": ("weight_decay",)}


@dataclasses.dataclass
class Start:
    """How a run starts, as this module decided it (every rank gets it)."""

    folder: Optional[str] = None        # the run's checkpoint folder (None: it has none)
    run_id: Optional[str] = None
    path: Optional[str] = None          # the checkpoint the run continues from (None: a new run)
    state: Optional[dict] = None        # that checkpoint's content
    fork: bool = False                  # a new run from another run's checkpoint
    again: bool = False                 # run() again on this engine: on from where the last one ended

    @property
    def stopped(self) -> bool:
        """The run continued had stopped (``stop_training``, e.g. EarlyStopping): nothing more is trained."""
        return bool(self.state and self.state.get("stopped")) and not self.fork

    def public(self) -> "Start":
        """What the main process sends the other ranks (they load the checkpoint themselves)."""
        return dataclasses.replace(self, state=None)


def _decided_by_main(decide: Callable[[], Any], public: Callable[[Any], Any] = lambda r: r) -> Any:
    """Run ``decide`` on the main process; the other ranks receive ``public(result)``. An error
    it raises is raised on every rank (same type and message)."""
    outcome: Tuple[str, Any] = ("ok", None)
    result = None
    if comm.is_main_process():
        try:
            result = decide()
            outcome = ("ok", public(result))
        except Exception as e:
            if comm.get_world_size() == 1:
                raise
            outcome = ("error", e if isinstance(e, UsageError) else (type(e).__name__, str(e)))
    outcome = comm.broadcast_object(outcome)
    if outcome[0] == "error":
        if isinstance(outcome[1], UsageError):   # the same kind on every rank (a command shows it as one line)
            raise outcome[1]
        name, message = outcome[1]
        kind = getattr(builtins, name, RuntimeError)
        raise (kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError)(message)
    return result if comm.is_main_process() else outcome[1]


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def claim_work_dir(cfg: Any) -> None:
    """At the trainer's construction, before a script writes anything into ``work_dir``: refuse
    a new run in a ``work_dir`` that holds a run (checkpoints, or the marker a run leaves when it
    starts), or move that run aside (``overwrite``). Also removes the temp files of killed
    writes at its top level."""
    work_dir, resume, overwrite = cfg.get("work_dir"), cfg.get("resume") or "", bool(cfg.get("overwrite"))

    def decide() -> Optional[str]:
        found = run_folder.find_runs(work_dir)
        continuing = resume == "auto" or (resume and _inside(resume, work_dir))
        # a new run writes; continuing one may only read it (evaluate a finished run kept read-only)
        run_folder.check_writable(work_dir, writes=not (found and continuing and not overwrite))
        atomic.remove_stale_temps(work_dir)
        if not found or (continuing and not overwrite):
            run_folder.check_none_running(found)   # before the script writes its config or log there
            return resume
        if not overwrite:
            raise run_folder.refusal(f"work_dir={work_dir!r}", found)
        moved = run_folder.move_aside(work_dir)
        if resume and resume != "auto" and _inside(resume, work_dir):   # it moved with the folder
            return os.path.join(moved, os.path.relpath(os.path.abspath(resume), os.path.abspath(work_dir)))
        return resume

    if work_dir:
        cfg["resume"] = _decided_by_main(decide)


def _previous_files(trainer: Any, folder: Optional[checkpoint.CheckpointFolder]) -> List[str]:
    """Files of an earlier run in this run's folders (checkpoints, logs)."""
    files: List[str] = []
    for cb in trainer.checkpointer.callbacks():
        files += list(cb.run_files())
    if folder is not None:
        files += [p for p in (folder.last, folder.previous) if os.path.exists(p)]
    return sorted(set(files))


def _folders(trainer: Any, folder: Optional[checkpoint.CheckpointFolder]) -> List[str]:
    found = [folder.folder] if folder is not None else []
    for cb in trainer.checkpointer.callbacks():
        found += [f for f in cb.run_folders() if f]
    return sorted(set(found))


# what a plan of an epoch's batches (loader.epoch_plan) holds, named as the user sets it
_PLAN_NAMES = {"samples": "training samples", "batch_size": "batch_size", "shuffle": "shuffle",
               "balance": "balance"}


def _refuse_other_runs(trainer: Any, state: dict, path: str) -> None:
    changes = checkpoint.config_changes(state.get("config") or {}, dict(trainer.cfg))
    breaking = [c for c in changes if c[0] in checkpoint.IDENTITY_KEYS]
    if breaking:
        raise ConfigError(
            f"resume from {path}: the config changes what is trained, so this would not continue that run: "
            + "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in breaking)
            + ". Keep those values to resume it, or start a new run: another work_dir, or overwrite: true "
              "(moves the old run aside)")
    epoch, phase, batch = checkpoint.position(state)
    if phase != "train" or not batch:
        return
    # the position counts batches of the old size, and accumulation windows start at the epoch's first batch
    layout = [c for c in changes if c[0] in ("batch_size", "accumulate_steps")]
    saved_plan, plan = state.get("epoch_plan") or {}, loaders.epoch_plan(trainer.train_loader, epoch)
    if saved_plan and plan:   # the order was drawn with these (balance's resampled list included)
        if batch < saved_plan.get("batches", batch + 1):   # else no batch of that order is left to train
            layout += _plan_changes(saved_plan, plan, {key for key, _, _ in layout})
    else:   # an older checkpoint, or a loader not made by build_dataloader: the config key that draws it
        layout += [c for c in changes if c[0] == "balance"]
    if layout:
        raise ConfigError(
            f"resume from {path}: it was saved inside epoch {epoch} (after step {batch}), and the epoch's batches "
            f"are laid out otherwise now: " + "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in layout)
            + f". The steps after the stop would not continue the {batch} before it (other batches: samples seen "
              f"twice, others never). Resume with the old values to finish epoch {epoch} (from the checkpoint at "
              f"its end on, the new ones apply), or start a new run: another work_dir, or overwrite: true")


def _plan_changes(saved: Dict[str, Any], current: Dict[str, Any], named: Set[str]) -> List[Tuple[str, Any, Any]]:
    """``(what, saved, current)`` for each setting of an epoch's plan (``loader.epoch_plan``)
    that differs, those in ``named`` (config keys already reported) left out; the order itself
    when it differs with every setting the same (e.g. a training set's labels changed)."""
    out = [(name, saved.get(key), current.get(key)) for key, name in _PLAN_NAMES.items()
           if saved.get(key) != current.get(key)]
    if not out and saved.get("order") != current.get("order"):
        out.append(("the epoch's sample order (same settings: the training set's content?)",
                    saved.get("order"), current.get("order")))
    return [c for c in out if c[0] not in named]


def _choose_folder(trainer: Any) -> Optional[str]:
    """The checkpoint folder of this run: the candidate already holding its checkpoints (or its
    marker), so that adding a ModelCheckpoint in front keeps the run where it is; else the first."""
    candidates = trainer.checkpointer.candidates()
    for folder in candidates:
        if any(os.path.exists(os.path.join(folder, name))
               for name in (checkpoint.LAST, checkpoint.PREVIOUS, run_folder.MARKER)):
            return folder
    return candidates[0] if candidates else None


def _clear_folders(trainer: Any, folder: Optional[checkpoint.CheckpointFolder], overwrite: bool,
                   what: str) -> None:
    """Refuse to start in folders holding another run's files, or move them aside."""
    existing = _previous_files(trainer, folder)
    if existing and not overwrite:
        raise run_folder.refusal(os.path.dirname(existing[0]), existing, what)
    moved: List[str] = []
    for f in sorted({os.path.dirname(os.path.abspath(p)) for p in existing}, key=len):
        if not any(f == m or f.startswith(m + os.sep) for m in moved):
            run_folder.move_aside(f)
            moved.append(f)


def _decide(trainer: Any) -> Start:
    """The main process's decision: the run's checkpoint folder, and the checkpoint it continues
    from (or none: a new run), or ``run()`` again."""
    cfg = trainer.cfg
    resume, overwrite = cfg.get("resume") or "", bool(cfg.get("overwrite"))
    chosen = _choose_folder(trainer)
    folder = trainer.checkpointer.folder(chosen) if chosen else None   # remembers a damaged last.pth
    run_folder.check_not_running(chosen)
    for f in _folders(trainer, folder):
        if os.path.isdir(f) and not os.access(f, os.W_OK | os.X_OK):
            raise PermissionError(f"this run cannot write to {f} (read-only?): give it a folder it may write to")
    if folder is not None:
        folder.recover()
    for f in _folders(trainer, folder):
        atomic.remove_stale_temps(f)
    if trainer.runs_done and trainer.run_id is not None:   # run() again: it goes on with its own files
        if _owned(trainer, folder):
            run_folder.write_marker(folder.folder, trainer.run_id)
        return Start(chosen, trainer.run_id, again=True)
    marker = run_folder.read_marker(chosen)
    if resume == "auto" and not overwrite:
        if folder is None:
            raise ConfigError("resume='auto' needs a checkpoint folder: set work_dir, or add a ModelCheckpoint")
        found = folder.find_resumable()
        if found is not None:
            _refuse_other_runs(trainer, found[1], found[0])
            return _continue(trainer, chosen, *found)
    elif resume and resume != "auto":
        state = checkpoint.load_file(resume, map_location="cpu")
        if not checkpoint.is_resumable(state):
            raise ConfigError(f"resume={resume!r} holds weights only, not a resumable checkpoint "
                             f"(optimizer, epoch, ...); use finetune for weights, or resume from last.pth")
        _refuse_other_runs(trainer, state, resume)
        if folder is not None and _inside(resume, folder.folder):
            return _continue(trainer, chosen, resume, state)
        # a new run that starts from another run's checkpoint: its folders must be its own
        _clear_folders(trainer, folder, overwrite, f"resume={resume!r} starts a new run from another folder's "
                                                   f"checkpoint")
        run_id = run_folder.new_run_id()
        if _owned(trainer, folder):
            run_folder.write_marker(folder.folder, run_id)
        return Start(chosen, run_id, resume, state, fork=True)
    if resume == "auto" and overwrite:
        logger.warning("overwrite: true starts a new run: resume='auto' is ignored")
    existing = _previous_files(trainer, folder)
    if existing and resume == "auto" and marker is not None and not overwrite:
        logger.warning("resume='auto': the run in %s saved no checkpoint yet; starting it from scratch "
                       "(its files are kept or replaced by the new ones)", folder.folder)
    else:
        _clear_folders(trainer, folder, overwrite, "a new run")
        if resume == "auto" and not overwrite:
            logger.warning("resume='auto': no checkpoint in %s yet; training from scratch", folder.folder)
    run_id = marker["run_id"] if (marker and resume == "auto" and not overwrite) else run_folder.new_run_id()
    if _owned(trainer, folder):
        run_folder.write_marker(folder.folder, run_id)
    return Start(chosen, run_id)


def _continue(trainer: Any, folder: Optional[str], path: str, state: dict) -> Start:
    """Continue the run of ``state`` (this folder's checkpoint), under its id."""
    return Start(folder, state.get("run_id") or trainer.run_id or run_folder.new_run_id(), path, state)


def _owned(trainer: Any, folder: Optional[checkpoint.CheckpointFolder]) -> bool:
    """Whether a callback keeps the run's checkpoints in ``folder`` (a ModelCheckpoint: then it is
    marked as this run's when the run starts; a bare ``<work_dir>/model`` only gets a file if a
    preemption saves one)."""
    return folder is not None and any(
        c.last_checkpoint_dir() and os.path.abspath(c.last_checkpoint_dir()) == os.path.abspath(folder.folder)
        for c in trainer.checkpointer.callbacks())


def prepare_run(trainer: Any) -> None:
    """Apply the run-folder rules and ``cfg.resume`` to ``trainer`` (at the start of ``run()``):
    decide how the run starts and hand that to ``trainer.checkpointer``."""
    start = _decided_by_main(lambda: _decide(trainer), public=Start.public)
    if start.path is not None and start.state is None:   # a rank but the main process: read what it chose
        start.state = checkpoint.load_file(start.path, map_location="cpu")
    state, optimizer = start.state, trainer.optimizer
    changes = checkpoint.config_changes(state.get("config") or {}, dict(trainer.cfg)) if state is not None else []
    built = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] if optimizer else []
    trainer.checkpointer.start(start)
    if start.again:
        _say_if_done(trainer, "the last run()")
    if state is None:
        return
    for key, _, _ in changes:   # the new config's optimizer settings, not the saved ones
        for group, fresh in zip(optimizer.param_groups if optimizer else [], built):
            for name in _OPTIMIZER_KEYS.get(key, ()):
                if name in fresh:
                    group[name] = fresh[name]
    if comm.is_main_process():
        folder = trainer.checkpoint_folder()
        if _owned(trainer, folder):   # this process holds the run now (see run_folder.check_not_running)
            run_folder.write_marker(folder.folder, trainer.run_id)
        if changes:
            logger.warning("resume from %s: the config differs from the checkpoint's; using the new values:\n%s",
                           start.path, "\n".join(f"  {k}: {old!r} -> {new!r}" for k, old, new in changes))
        if start.stopped:
            logger.warning("resume from %s: that run had stopped (stop_training, e.g. EarlyStopping) at the %s: "
                           "nothing more is trained. To train on, start a new run from it: resume: %s with "
                           "another work_dir", start.path, checkpoint.describe(state), start.path)
        elif trainer.start_epoch >= int(trainer.num_epochs):   # one line: nothing was interrupted, nothing follows
            planned = (state.get("config") or {}).get("num_epochs")
            if planned in (None, trainer.start_epoch) and trainer.start_epoch == int(trainer.num_epochs):
                logger.warning("the run in %s finished all %d epochs (%s): nothing left to train; raise num_epochs "
                               "to train on", os.path.normpath((trainer.cfg or {}).get("work_dir") or
                                                               os.path.dirname(start.path)),
                               trainer.start_epoch, os.path.basename(start.path))
            else:
                _say_if_done(trainer, start.path)
        else:
            logger.info("resumed from %s (%s): continuing at epoch %d, step %d of it (global step %d)", start.path,
                        checkpoint.describe(state), trainer.start_epoch, trainer.batch_in_epoch, trainer.global_step)


def _say_if_done(trainer: Any, source: str) -> None:
    if comm.is_main_process() and trainer.start_epoch >= int(trainer.num_epochs):
        logger.warning("nothing left to train: %s ended with epoch %d and num_epochs is %d; raise num_epochs "
                       "to train on", source, trainer.start_epoch - 1, trainer.num_epochs)
