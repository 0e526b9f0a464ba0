"""The training loop: one loop, shared by CPU, one GPU, DataParallel and DDP.

Everything that is not the loop itself (figures, logging, checkpoints, LR) is a callback; the
order of the events is written once, in :class:`~basetrainer.callbacks.callbacks.Callback`.
"""
import contextlib
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from basetrainer.callbacks.callbacks import Callback, CallbackList
from basetrainer.dataloader import loader as loaders
from basetrainer.engine import data_wait, precision
from basetrainer.engine.checkpointer import Checkpointer, with_position
from basetrainer.engine.checks import check_ready
from basetrainer.engine.guard import NonFiniteGuard, total_loss
from basetrainer.engine.history import History
from basetrainer.engine import preemption
from basetrainer.engine.steps import EpochSteps
from basetrainer.models.sync_batchnorm import placeholder_batch
from basetrainer.runtime import comm, sharding, watchdog
from basetrainer.runtime.modules import unwrap_model

logger = logging.getLogger(__name__)


@with_position   # epoch, phase, global_step, ...: the checkpointer's (checkpointer.POSITION)
class Engine:
    """The loop. Set ``model``, ``optimizer``, ``criterion``, ``train_loader`` (and optionally
    ``test_loader``, ``callbacks``, ``num_epochs``, ``device``), then call :meth:`run`.

    Most users subclass :class:`~basetrainer.engine.trainer.EngineTrainer`, which builds these
    from a config. Override :meth:`run_step` to change the forward pass.

    Example::

        engine = Engine()
        engine.model, engine.optimizer, engine.criterion = model, optimizer, nn.CrossEntropyLoss()
        engine.train_loader, engine.num_epochs = loader, 3
        history = engine.run()
    """

    def __init__(self, cfg: Any = None) -> None:
        self.cfg = cfg
        self.model: Optional[nn.Module] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.criterion: Optional[nn.Module] = None
        self.train_loader: Optional[Any] = None
        self.test_loader: Optional[Any] = None
        self.callbacks: List[Callback] = []
        self.num_epochs = 1
        self.device = torch.device("cpu")
        self.progress, self.log_freq, self.seed, self.channels_last = False, 50, 0, False
        self.amp, self.accumulate_steps = "none", 1      # amp: none | fp16 | bf16
        self.clip_grad_norm: Optional[float] = None
        self.loss_in_replica = False    # model is DataParallel(ModelWithLoss): it returns the loss too
        self.stop_training, self.history = False, History()
        self.logs: Dict[str, Any] = {}  # the run's logs (a fresh dict per run)
        self.runs_done = 0              # run() calls that ended (a next one goes on from there)
        self.scaler: Optional[torch.amp.GradScaler] = None
        self._callbacks = CallbackList([], self)
        self._guard = NonFiniteGuard()
        self._preemption = preemption.Preemption()
        self.checkpointer = Checkpointer(self, self._guard)   # the position, saves, the start point
        self._steps_in_epoch, self._non_blocking = 0, False
        self.loss_reduction = "mean"    # what run_step's loss is over the batch: mean | sum
        self._steps: Optional[EpochSteps] = None
        self._placeholder = False       # this step's batch is a placeholder (no sample of this rank)
        self._updated = True            # the last step ended its accumulation window
        self._compile_checked = True
        self._buffer_sync: Optional[Callable[[], None]] = None   # ddp/fsdp: rank 0's buffers to all, each step
        # the data-stall meter: advice over this share of waiting (0: never); the last train phase's DataWait
        self.data_wait_warn, self.data_wait = 0.3, None
        # the stall watchdog: seconds without progress before a report (0: off), in this folder (work_dir/log)
        self.stall_timeout, self.stall_folder = watchdog.DEFAULT_STALL_TIMEOUT, "log"

    # ----------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: Optional[str] = None, background: bool = False) -> Optional[str]:
        """A resumable checkpoint of this point (``Checkpointer.save``); inside an accumulation window, at its end."""
        return self.checkpointer.save(path, background, in_window=not self._updated)

    def preempt(self, where: str) -> None:
        """Save a resumable checkpoint of this point and exit with status 128 + signal number."""
        self._preemption.exit(where, self.save_checkpoint(), comm.is_main_process())

    def restore(self) -> None:
        """Hook called at the start of :meth:`run`; the trainer applies ``resume`` here."""

    # ----------------------------------------------------------------------------- callbacks
    def extra_callbacks(self) -> List[Any]:
        """Callbacks the engine adds to the user's list for a run (the trainer's progress bar)."""
        return []

    def dispatch(self, event: str, *args: Any) -> None:
        """Call ``event`` on every callback in list order; a failure names the callback."""
        self._callbacks.call(event, *args)

    # ----------------------------------------------------------------------------- the loop
    def run(self, logs: Optional[dict] = None) -> History:
        """Train for ``num_epochs`` epochs (from ``start_epoch``) and return the :class:`History`.

        Args:
            logs: initial content of the run's ``logs`` dict (copied; a fresh dict per run).
        """
        check_ready(self)
        self.scaler = self.scaler or precision.make_scaler(self.amp)
        self._non_blocking = self.device.type == "cuda"
        self._callbacks = CallbackList(list(self.callbacks or []) + self.extra_callbacks(), self)   # bound: restore
        self.restore()
        self._buffer_sync = sharding.buffer_sync(self.model)
        self.logs = logs = {**self.checkpointer.restored_logs, **(logs or {})}
        for loader in (self.train_loader, self.test_loader):
            preemption.shield_loader(loader)
        self.history, self.stop_training = History(), False
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        finished = False
        with self._preemption, self.stall_watchdog(), self.checkpointer.in_run():
            try:
                self.dispatch("on_train_begin", logs)
                first = self.num_epochs if comm.any_true(self.stop_training) else self.start_epoch   # stopped at begin
                for epoch in range(first, self.num_epochs):
                    self.run_epoch(epoch, logs)
                    if comm.any_true(self.stop_training):
                        logger.info("stop_training set: training ends after epoch %d", epoch)
                        break
                    if comm.any_true(self._preemption.requested):
                        self.preempt(f"the end of epoch {epoch}")
                finished = True
            finally:
                self.runs_done += 1
                try:
                    self._callbacks.call_all("on_train_end", logs, raise_first=finished)  # always, all
                finally:   # also the workers a callback started there
                    preemption.end_workers(self.train_loader, self.test_loader)
        return self.history

    def stall_watchdog(self) -> watchdog.Watchdog:
        """The stall watchdog of a run (``with self.stall_watchdog():``; see :mod:`basetrainer.runtime.watchdog`)."""
        return watchdog.Watchdog(self.stall_timeout, self.stall_folder, comm.get_rank(), comm.get_world_size())

    def run_epoch(self, epoch: int, logs: dict) -> None:
        """One epoch: the train phase, the test phase, the epoch end and its checkpoint."""
        ckpt = self.checkpointer
        train = ckpt.enter_epoch(epoch)   # False: the run starts at this epoch's test phase
        self.set_epoch(epoch)
        self.dispatch("on_epoch_begin", epoch, logs)
        if self.train_loader is not None and train:
            self.run_train_epoch(epoch, logs)
        with ckpt.test_phase():
            self.dispatch("on_test_begin", logs)
            if self.test_loader is not None:
                self.run_test_epoch(epoch, logs)
            self.dispatch("on_test_end", logs)
        self.dispatch("on_epoch_end", epoch, logs)
        self.history.append(epoch, logs)
        ckpt.end_epoch()   # and the checkpoint asked for: after every on_epoch_end, all states are final

    def set_epoch(self, epoch: int) -> None:
        """Tell the train loader's (distributed) sampler which epoch it is: it reshuffles."""
        loaders.set_epoch(self.train_loader, epoch, self.seed, comm.get_rank())

    def run_train_epoch(self, epoch: int, logs: dict) -> None:
        self.model.train()
        self._steps = EpochSteps(self.train_loader, self.accumulate_steps, self.loss_reduction)
        self._steps_in_epoch = self._steps.steps
        ckpt = self.checkpointer
        clock, waited = time.perf_counter, 0.0   # the data-stall meter: seconds inside the loader (data_wait.py)
        began = mark = clock()
        start, batches = ckpt.enter_train(self.train_loader, preemption.start)   # a resume: after the stop
        progress = watchdog.PROGRESS
        for batch, data in enumerate(batches, start=start):
            waited += clock() - mark   # in next() since the last step's end (opening the loader, for the first)
            self.dispatch("on_batch_prepare", epoch, batch, logs)
            self.dispatch("on_batch_begin", batch, logs)
            data = self.to_device(data)
            outputs, losses = self.train_step(data, batch)
            progress.batches += 1   # more batches than backward passes (steps): this rank skipped one
            ckpt.batch_in_epoch = batch + 1
            if not self._placeholder:   # a placeholder batch holds no sample of this rank
                self.dispatch("on_train_summary", data, outputs, losses, epoch, batch, logs)
            self.dispatch("on_batch_end", batch, logs)
            progress.count += 1   # the stall watchdog's stamp: an attribute write, no call
            if check := self.should_log(batch):
                self._guard.check(epoch)
            if self._updated and ckpt.deferred is not None:   # asked this step, or inside the window
                self.save_checkpoint(background=ckpt.deferred)
            if self._preemption.stop_agreed(check) and self._updated:   # a signal: stop at a window's end
                self.preempt(f"epoch {epoch}, step {batch + 1}")
            mark = clock()
        waited += clock() - mark       # the next() that ended the loop
        seconds = clock() - began
        self._guard.check(epoch)
        self.data_wait = data_wait.gather(epoch, waited, seconds, self.train_loader, self.data_wait_warn)

    def train_step(self, data: Any, batch: int) -> Tuple[Any, Any]:
        """Forward, backward (the loss weighted by this rank's share of the window's samples,
        see :mod:`basetrainer.engine.steps`) and, at the window's end, the optimizer step."""
        update, weight, self._placeholder = self._steps.plan(batch)
        with sharding.sync_gradients(self.model, update):   # DDP no_sync / FSDP: inside a window
            with self.autocast(), placeholder_batch() if self._placeholder else contextlib.nullcontext():
                try:
                    outputs, losses = self.run_step(data)
                except Exception as e:   # compile's errors mostly surface at the first step
                    if self._compile_checked:
                        raise
                    raise RuntimeError(f"torch.compile failed on the first step ({type(e).__name__}: {e}); "
                                       f"set compile: false to train without it") from e
                self._compile_checked = True
            loss = total_loss(losses)
            self._guard.watch(batch, loss, losses)
            if weight != 1.0:
                loss = loss * weight
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
        self._updated = update
        if update:
            self.optimizer_step()
        watchdog.PROGRESS.steps += 1   # train steps done (see the loop's batches)
        return outputs, losses

    def optimizer_step(self) -> None:
        """Unscale (fp16), clip, step, zero the gradients."""
        optimizer, scaler = self.optimizer, self.scaler
        if self.clip_grad_norm:
            if scaler is not None:
                scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self._buffer_sync is not None:
            self._buffer_sync()
        self.checkpointer.global_step += 1

    @torch.no_grad()
    def run_test_epoch(self, epoch: int, logs: dict) -> None:
        wrapped = self.model
        # DDP's forward may talk to the other ranks, which hold other numbers of test batches
        if isinstance(wrapped, nn.parallel.DistributedDataParallel):
            self.model = wrapped.module
        self.model.eval()
        most, done = sharding.most_test_batches(self), 0   # FSDP: every rank forwards as often
        progress = watchdog.PROGRESS
        try:
            for done, data in enumerate(preemption.start(self.test_loader), start=1):
                batch = done - 1
                data = self.to_device(data)
                with self.autocast():
                    outputs, losses = self.run_step(data)
                self.dispatch("on_test_summary", data, outputs, losses, epoch, batch, logs)
                progress.count += 1
                # one process stops after this batch (the resume repeats the test phase); ranks
                # hold different numbers of test batches, so DDP stops at the epoch's end
                if self._preemption.requested and comm.get_world_size() == 1:
                    self.preempt(f"epoch {epoch}, test batch {batch + 1}")
            sharding.even_out_test_forwards(self, most - done)
        finally:
            self.model = wrapped

    def run_step(self, inputs: Any) -> Tuple[Any, Any]:
        """One forward pass of ``inputs`` (a batch on ``self.device``; by default ``(data,
        targets)``): ``(outputs, losses)``, losses a tensor, a tuple or a dict of tensors.
        Override for other batch shapes or models."""
        if isinstance(inputs, dict) or not isinstance(inputs, (list, tuple)) or len(inputs) < 2:
            raise TypeError(f"the default run_step takes (inputs, targets) batches, got a {type(inputs).__name__}"
                            + (f" with keys {sorted(inputs)}" if isinstance(inputs, dict) else "")
                            + f": override {type(self).__name__}.run_step(self, batch) -> (outputs, losses), "
                              f"or make the data set return (inputs, targets)")
        data, targets = inputs[0], inputs[1]
        if self.loss_in_replica:
            outputs, loss_sums, counts = self.model(data, targets)
            return outputs, loss_sums.sum() / counts.sum()
        outputs = self.model(data)
        return outputs, self.criterion(outputs, targets)

    # ----------------------------------------------------------------------------- helpers
    def should_log(self, batch: int) -> bool:
        """True on the steps where running figures are read (every ``log_freq`` and the last)."""
        return (batch + 1) % max(1, int(self.log_freq)) == 0 or batch + 1 == self._steps_in_epoch

    def to_device(self, batch: Any) -> Any:
        """Move a batch (tensors in tuples/lists/dicts) to ``self.device``."""
        return loaders.to_device(batch, self.device, self._non_blocking, self.channels_last)

    def autocast(self) -> Any:
        return precision.autocast(self.amp, self.device)

    @property
    def unwrapped_model(self) -> nn.Module:
        """The model without DataParallel/DDP/compile wrappers (FSDP shards it in place)."""
        return unwrap_model(self.model)
