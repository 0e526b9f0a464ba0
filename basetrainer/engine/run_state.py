"""The run's state as the engine sees it: where its checkpoints go, saving and restoring them.

A mixin of :class:`~basetrainer.engine.engine.Engine`; the files themselves are written, found
and loaded by :mod:`basetrainer.runtime.checkpoint` (their one home).
"""
import os
from typing import Any, List, Optional

from basetrainer.runtime import atomic, checkpoint, comm, sharded, sharding
from basetrainer.utils import torch_tools


class RunState:
    """Saving and restoring the engine's state (model, optimizer, scaler, callbacks, RNG,
    position in the run)."""

    cfg: Any
    callbacks: List[Any]
    checkpoints: Optional[checkpoint.CheckpointFolder]

    def checkpoint_candidates(self) -> List[str]:
        """Where ``last.pth`` may go: every ModelCheckpoint's folder, in list order, then
        ``<work_dir>/model``."""
        found = [c.model_dir for c in self.callbacks or [] if getattr(c, "model_dir", None) and hasattr(c, "save_last")]
        work_dir = getattr(self.cfg, "get", lambda *_: None)("work_dir")
        found += [os.path.join(work_dir, "model")] if work_dir else []
        return list(dict.fromkeys(found))

    def checkpoint_dir(self) -> Optional[str]:
        """The folder of ``last.pth``: the one chosen when the run started (the candidate that
        already holds this run's checkpoints, else the first), else the first candidate (see
        :meth:`checkpoint_candidates`), else None (no resumable checkpoints)."""
        if self._checkpoint_dir is not None:
            return self._checkpoint_dir
        candidates = self.checkpoint_candidates()
        return candidates[0] if candidates else None

    def checkpoint_folder(self) -> Optional[checkpoint.CheckpointFolder]:
        folder = self.checkpoint_dir()
        if folder and (self.checkpoints is None or self.checkpoints.folder != folder):
            self.checkpoints = checkpoint.CheckpointFolder(folder)
        return self.checkpoints if folder else None

    def request_checkpoint(self, background: bool = True) -> None:
        """Ask for ``last.pth`` at the end of this epoch, after every ``on_epoch_end`` (every
        rank asks; ModelCheckpoint does)."""
        asked = self._checkpoint_asked
        self._checkpoint_asked = background if asked is None else (asked and background)

    def save_checkpoint(self, path: Optional[str] = None, background: bool = False) -> Optional[str]:
        """Write a resumable checkpoint of this point (every rank calls it: it gathers every
        rank's RNG state; the main process writes). A second save at the same point writes
        nothing. Inside an accumulation window the save waits for the window's end (the
        accumulated gradients are not saved). Returns the path (None without a checkpoint
        folder, or when the save waits).

        Args:
            path: default ``<checkpoint_dir()>/last.pth`` (then the files callbacks staged are
                written first, and the previous ``last.pth`` is kept as ``last.prev.pth``).
            background: copy the state and write it in the background writer thread.

        Raises:
            FloatingPointError: a loss since the last check, or a weight, is not finite.
        """
        self._guard.check(self.epoch)   # never save the state after a non-finite loss
        folder = self.checkpoint_folder()
        if path is None and folder is None:
            return None
        if self.phase == "train" and not self._updated:   # inside an accumulation window
            self._save_deferred = background if self._save_deferred is None else (self._save_deferred and background)
            return None
        self._save_deferred = None
        at = (self.epoch, self.phase, self.batch_in_epoch, self.global_step)
        if path is None and at == self._saved_at:
            if not background:
                atomic.wait_for_writes()
            return folder.last
        for cb in self.callbacks or []:   # every rank: callbacks may reduce per-rank state here
            if hasattr(cb, "prepare_state"):
                cb.prepare_state()
        rngs = comm.all_gather_object(checkpoint.rng_state())
        target = folder if path is None else checkpoint.CheckpointFolder(os.path.dirname(os.path.abspath(path)))
        if sharding.is_fsdp(self.model):   # every rank writes its shards (in the foreground)
            sharded.save(self, target, rngs, path)
        elif comm.is_main_process():
            target.commit(self.state_dict(rng=rngs), background=background, path=path)
        if path is None:
            self._saved_at = at
        comm.synchronize()
        return path or folder.last

    def state_dict(self, rng: Optional[List[dict]] = None) -> dict:
        """Everything a resume needs (see :func:`basetrainer.runtime.checkpoint.capture`)."""
        return checkpoint.capture(self, rng)

    def load_state_dict(self, state: dict, source: str = "checkpoint") -> None:
        """Restore :meth:`state_dict`: training continues after the saved point (inside the
        epoch, skipping the batches already trained, for a mid-epoch checkpoint)."""
        model = self.unwrapped_model
        if state.get("shards"):   # a sharded checkpoint: read (and reshard) the tensors it refers to
            state = sharded.load(state, os.path.dirname(os.path.abspath(source)), sharding.mesh_of(model))
        if state.get("shards") or sharding.is_fsdp(model):
            sharding.load_state(model, self.optimizer, state, full=not state.get("shards"))
        else:
            torch_tools.load_weights(self.model, state["model"], strict=True, source=source)
            if self.optimizer is not None and state.get("optimizer"):
                self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        checkpoint.load_callback_states(self.callbacks, state.get("callbacks", {}), source)
        rngs = state.get("rng") or []
        rngs = [rngs] if isinstance(rngs, dict) else rngs
        if rngs:
            rank = comm.get_rank()
            self._pending_rng = rngs[rank] if len(rngs) == comm.get_world_size() else rngs[0]
        epoch, phase, batch = checkpoint.position(state)
        self.start_epoch = epoch + 1 if phase == "end" else epoch
        self._skip_batches = batch if phase == "train" else 0
        self.batch_in_epoch = 0 if phase == "end" else batch   # train steps of start_epoch already done
        self._start_phase = "test" if phase == "test" else "train"
        self.global_step = int(state.get("global_step", 0))
        self._restored_logs = dict(state.get("logs") or {})
        self.run_id = state.get("run_id") or self.run_id
        self._saved_at = (epoch, phase, batch, self.global_step)

    def restore(self) -> None:
        """Hook called at the start of :meth:`run`; the trainer applies ``resume`` here."""

    def _apply_pending_rng(self) -> None:
        """Resume: restore the random generators exactly where the saved run was."""
        if self._pending_rng is not None:
            checkpoint.set_rng_state(self._pending_rng)
            self._pending_rng = None

    def _stop_requested(self, batch: int) -> bool:
        """A signal asked to stop. One process: stop after this step. DDP: every rank must stop
        at the same step, so all ranks compare flags every ``log_freq`` steps (a signal that
        reached any rank stops them all). Inside an accumulation window: at its end."""
        if not self._stop_agreed:
            if self._group_size == 1:
                self._stop_agreed = self._preemption.requested
            elif self.should_log(batch):
                self._stop_agreed = comm.any_true(self._preemption.requested)
        return self._stop_agreed and self._updated

    def preempt(self, where: str) -> None:
        """Save a resumable checkpoint of this point and exit with status 128 + signal number."""
        path = self.save_checkpoint()
        self._preemption.exit(where, path, comm.is_main_process())

    @property
    def epoch_complete(self) -> bool:
        """The current epoch has ended (its figures are final)."""
        return self.phase == "end"
