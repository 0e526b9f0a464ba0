"""The training loop: one loop, shared by CPU, one GPU, DataParallel and DDP.

Everything that is not the loop itself (figures, logging, checkpoints, LR) is a callback; the
order of the events is written once, in :class:`~basetrainer.callbacks.callbacks.Callback`.
"""
import contextlib
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from basetrainer.callbacks.callbacks import Callback
from basetrainer.engine import comm
from basetrainer.engine.history import History

logger = logging.getLogger(__name__)

_EVENTS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_batch_prepare",
           "on_batch_begin", "on_batch_end", "on_train_summary", "on_test_begin", "on_test_summary",
           "on_test_end")
AMP_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def total_loss(losses: Any) -> torch.Tensor:
    """The loss to back-propagate: a tensor as is, the sum of a tuple/list or of a dict's values."""
    if isinstance(losses, torch.Tensor):
        return losses
    if isinstance(losses, dict):
        losses = list(losses.values())
    if isinstance(losses, (list, tuple)) and losses:
        return sum(losses[1:], losses[0])
    raise TypeError(f"run_step must return losses as a tensor, tuple or dict of tensors, got {type(losses).__name__}")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside DataParallel / DistributedDataParallel / torch.compile wrappers."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        elif isinstance(model, ModelWithLoss):
            model = model.model
        else:
            return model


class _NonFiniteGuard:
    """Finds a non-finite loss without a host sync per step.

    Each step only keeps a reference to the detached loss; every ``log_freq`` steps (and at the
    end of the epoch) the pending losses are checked at once, and the first bad one raises
    :class:`FloatingPointError` naming its epoch, step and losses.
    """

    def __init__(self) -> None:
        self.pending: List[Tuple[int, torch.Tensor, Any]] = []

    def watch(self, batch: int, loss: torch.Tensor, losses: Any) -> None:
        parts = losses.detach() if isinstance(losses, torch.Tensor) else (
            {k: v.detach() for k, v in losses.items()} if isinstance(losses, dict)
            else [v.detach() for v in losses])
        self.pending.append((batch, loss.detach(), parts))

    def check(self, epoch: int) -> None:
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        finite = torch.isfinite(torch.stack([p[1].float().reshape(()) for p in pending]))
        if bool(finite.all()):
            return
        batch, loss, parts = pending[int((~finite).nonzero()[0])]
        if isinstance(parts, dict):
            shown = {k: float(v) for k, v in parts.items()}
        elif isinstance(parts, list):
            shown = [float(v) for v in parts]
        else:
            shown = float(parts)
        raise FloatingPointError(
            f"non-finite loss at epoch {epoch}, step {batch}: loss={float(loss)} (losses: {shown}). "
            f"Lower the learning rate, enable clip_grad_norm, or check the data and the model.")


class ModelWithLoss(nn.Module):
    """Model and criterion in one module, so that under DataParallel every replica computes
    the loss of its own slice; only outputs and two numbers per replica are gathered on the
    first device. Returns ``(outputs, loss x samples, samples)``: the engine divides the sums,
    which gives the exact sample-weighted mean over the whole batch."""

    def __init__(self, model: nn.Module, criterion: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.criterion = criterion

    def forward(self, data: Any, targets: torch.Tensor) -> Tuple[Any, torch.Tensor, torch.Tensor]:
        outputs = self.model(data)
        loss = self.criterion(outputs, targets)
        count = torch.full((1,), float(targets.shape[0]), device=loss.device)
        return outputs, loss.reshape(1) * count, count


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
        self.start_epoch = 0
        self.epoch = 0
        self.global_step = 0            # optimizer steps taken so far
        self.device = torch.device("cpu")
        self.progress = False
        self.log_freq = 50
        self.amp = "none"               # none | fp16 | bf16
        self.accumulate_steps = 1
        self.clip_grad_norm: Optional[float] = None
        self.loss_in_replica = False    # model is DataParallel(ModelWithLoss): it returns the loss too
        self.stop_training = False
        self.history = History()
        self.scaler: Optional[torch.amp.GradScaler] = None
        self._handlers: Dict[str, List[Tuple[str, Any]]] = {}
        self._guard = _NonFiniteGuard()
        self._steps_in_epoch = 0
        self._non_blocking = False
        self.channels_last = False
        self.seed = 0
        self.batch_in_epoch = 0         # train steps done in the current epoch
        self.epoch_complete = False     # the current epoch's train phase has finished
        self._skip_batches = 0          # mid-epoch resume: batches of start_epoch already trained
        self._pending_rng: Optional[dict] = None
        self._compile_checked = True
        self._preempted: Optional[int] = None

    # ----------------------------------------------------------------------------- callbacks
    def _active_callbacks(self) -> List[Any]:
        callbacks = [c for c in (self.callbacks or []) if c is not None]
        if self.progress and comm.is_main_process():
            from basetrainer.callbacks.progress_bar import ProgressBar

            if not any(isinstance(c, ProgressBar) for c in callbacks):
                callbacks.append(ProgressBar())
        return callbacks

    def _bind_callbacks(self) -> None:
        """Give every callback the trainer and index, per event, those that implement it."""
        callbacks = self._active_callbacks()
        for cb in callbacks:
            if hasattr(cb, "set_trainer"):
                cb.set_trainer(self)
            elif hasattr(cb, "set_model"):
                cb.set_model(self.model)
        self._handlers = {}
        for event in _EVENTS:
            base = getattr(Callback, event)
            self._handlers[event] = [
                (type(cb).__name__, getattr(cb, event)) for cb in callbacks
                if getattr(type(cb), event, base) is not base and hasattr(cb, event)]

    def dispatch(self, event: str, *args: Any) -> None:
        """Call ``event`` on every callback in list order; a failure names the callback."""
        for name, handler in self._handlers.get(event, ()):
            try:
                handler(*args)
            except Exception as e:
                if hasattr(e, "add_note"):  # Python 3.11+
                    e.add_note(f"raised in callback {name}.{event}")
                raise

    # ----------------------------------------------------------------------------- the loop
    def run(self, logs: Optional[dict] = None) -> History:
        """Train for ``num_epochs`` epochs (from ``start_epoch``) and return the :class:`History`.

        Args:
            logs: initial content of the run's ``logs`` dict (copied; a fresh dict per run).
        """
        logs = dict(logs) if logs else {}
        self._check_ready()
        self._setup_precision()
        self.restore()
        self._bind_callbacks()
        self.history = History()
        self.stop_training = False
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        finished = False
        previous = self._install_signal_handlers()
        try:
            self.dispatch("on_train_begin", logs)
            for epoch in range(self.start_epoch, self.num_epochs):
                self.epoch = epoch
                self.set_epoch(epoch)
                self.dispatch("on_epoch_begin", epoch, logs)
                if self.train_loader is not None:
                    self.run_train_epoch(epoch, logs)
                self.dispatch("on_test_begin", logs)
                if self.test_loader is not None:
                    self.run_test_epoch(epoch, logs)
                self.dispatch("on_test_end", logs)
                self.dispatch("on_epoch_end", epoch, logs)
                self.history.append(epoch, logs)
                if comm.any_true(self.stop_training):
                    logger.info("stop_training set: training ends after epoch %d", epoch)
                    break
            finished = True
        finally:
            self._restore_signal_handlers(previous)
            self._end(logs, finished)
        return self.history

    def _end(self, logs: dict, finished: bool) -> None:
        if finished:
            self.dispatch("on_train_end", logs)
            return
        # an exception is already on its way: never hide it behind one from on_train_end, and
        # let every callback close its files even when an earlier one fails here
        for name, handler in self._handlers.get("on_train_end", ()):
            try:
                handler(logs)
            except Exception:
                logger.exception("%s.on_train_end failed while handling an earlier error", name)

    def set_epoch(self, epoch: int) -> None:
        """Tell the train loader's (distributed) sampler which epoch it is: it reshuffles."""
        loader = self.train_loader
        done = []  # a DataLoader's batch_sampler usually wraps the same sampler: call it once
        for holder in (loader, getattr(loader, "batch_sampler", None)):
            sampler = getattr(holder, "sampler", None)
            if hasattr(sampler, "set_epoch") and not any(sampler is s for s in done):
                sampler.set_epoch(epoch)
                done.append(sampler)
        generator = getattr(loader, "generator", None)
        if isinstance(generator, torch.Generator):  # worker seeds follow (seed, epoch, rank) too
            generator.manual_seed((int(self.seed) * 1000003 + epoch * 7919 + comm.get_rank()) % 2 ** 63)

    def run_train_epoch(self, epoch: int, logs: dict) -> None:
        self.model.train()
        self._steps_in_epoch = len(self.train_loader)
        skip, self._skip_batches = self._skip_batches, 0
        self.epoch_complete = False
        if skip == 0:
            self._apply_pending_rng()
        for batch, data in enumerate(self.train_loader):
            if batch < skip:  # mid-epoch resume: these batches were trained before the stop
                if batch == skip - 1:  # generators as at the stop, before the next batch is made
                    self._apply_pending_rng()
                continue
            self.dispatch("on_batch_prepare", epoch, batch, logs)
            self.dispatch("on_batch_begin", batch, logs)
            data = self.to_device(data)
            outputs, losses = self.train_step(data, batch)
            self.batch_in_epoch = batch + 1
            self.dispatch("on_train_summary", data, outputs, losses, epoch, batch, logs)
            self.dispatch("on_batch_end", batch, logs)
            if self.should_log(batch):
                self._guard.check(epoch)
            if self._stop_requested(batch):
                self._guard.check(epoch)
                self.on_preempt(epoch, batch)
        self._guard.check(epoch)
        self.epoch_complete = True

    def train_step(self, data: Any, batch: int) -> Tuple[Any, Any]:
        """Forward, backward and (every ``accumulate_steps`` micro-batches) the optimizer step."""
        k = self.accumulate_steps
        start = (batch // k) * k
        end = min(start + k, self._steps_in_epoch)
        update = batch + 1 >= end
        no_sync = (not update and isinstance(self.model, nn.parallel.DistributedDataParallel))
        with self.model.no_sync() if no_sync else contextlib.nullcontext():
            with self.autocast():
                if self._compile_checked:
                    outputs, losses = self.run_step(data)
                else:
                    outputs, losses = self._first_compiled_step(data)
            loss = total_loss(losses)
            self._guard.watch(batch, loss, losses)
            if end - start > 1:
                loss = loss / (end - start)
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
        if update:
            self.optimizer_step()
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
        self.global_step += 1

    @torch.no_grad()
    def run_test_epoch(self, epoch: int, logs: dict) -> None:
        wrapped = self.model
        # DDP's forward may talk to the other ranks; ranks hold different numbers of test
        # batches (exact sharding), so evaluation runs on the unwrapped module.
        if isinstance(wrapped, nn.parallel.DistributedDataParallel):
            self.model = wrapped.module
        self.model.eval()
        try:
            for batch, data in enumerate(self.test_loader):
                data = self.to_device(data)
                with self.autocast():
                    outputs, losses = self.run_step(data)
                self.dispatch("on_test_summary", data, outputs, losses, epoch, batch, logs)
        finally:
            self.model = wrapped

    def run_step(self, inputs: Any) -> Tuple[Any, Any]:
        """One forward pass: ``(outputs, losses)``. Override for other batch shapes or models.

        Args:
            inputs: a batch from the loader, already on ``self.device``; by default
                ``(data, targets)``.

        Returns:
            ``(outputs, losses)``; losses may be a tensor, a tuple or a dict of tensors.
        """
        data, targets = inputs[0], inputs[1]
        if self.loss_in_replica:
            outputs, loss_sums, counts = self.model(data, targets)
            return outputs, loss_sums.sum() / counts.sum()
        outputs = self.model(data)
        losses = self.criterion(outputs, targets)
        return outputs, losses

    # ----------------------------------------------------------------------------- helpers
    def should_log(self, batch: int) -> bool:
        """True on the steps where running figures are read (every ``log_freq`` and the last)."""
        return (batch + 1) % max(1, int(self.log_freq)) == 0 or batch + 1 == self._steps_in_epoch

    def to_device(self, data: Any) -> Any:
        """Move a batch (tensors in tuples/lists/dicts) to ``self.device``."""
        if isinstance(data, torch.Tensor):
            if self.channels_last and data.dim() == 4 and data.is_floating_point():
                return data.to(self.device, non_blocking=self._non_blocking, memory_format=torch.channels_last)
            return data.to(self.device, non_blocking=self._non_blocking)
        if isinstance(data, tuple) and hasattr(data, "_fields"):
            return type(data)(*(self.to_device(v) for v in data))
        if isinstance(data, (list, tuple)):
            return type(data)(self.to_device(v) for v in data)
        if isinstance(data, dict):
            return {k: self.to_device(v) for k, v in data.items()}
        return data

    def autocast(self) -> Any:
        dtype = AMP_DTYPES[self.amp]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _setup_precision(self) -> None:
        if self.amp not in AMP_DTYPES:
            raise ValueError(f"amp={self.amp!r} is not a precision; choose from {sorted(AMP_DTYPES)}")
        if self.amp == "fp16" and self.device.type != "cuda":
            raise ValueError("amp='fp16' needs a CUDA device (it uses a GradScaler); "
                             "on the CPU use amp='bf16' or amp='none'")
        if self.scaler is None and self.amp == "fp16":
            self.scaler = torch.amp.GradScaler("cuda")
        self._non_blocking = self.device.type == "cuda"
        if not isinstance(self.accumulate_steps, int) or self.accumulate_steps < 1:
            raise ValueError(f"accumulate_steps={self.accumulate_steps!r} must be an integer >= 1")

    def _check_ready(self) -> None:
        missing = [name for name in ("model", "optimizer") if getattr(self, name) is None]
        if self.train_loader is not None and missing:
            raise RuntimeError(f"{type(self).__name__}.run(): {', '.join(missing)} not set; "
                               f"build them (build_model/build_optimizer) before run()")
        if self.train_loader is None and self.test_loader is None:
            raise RuntimeError(f"{type(self).__name__}.run(): neither train_loader nor test_loader is set")
        if self.num_epochs is None or int(self.num_epochs) <= 0:
            raise ValueError(f"num_epochs={self.num_epochs!r} must be a positive integer")

    def _apply_pending_rng(self) -> None:
        """Resume: restore the random generators exactly where the saved run was."""
        if self._pending_rng is not None:
            from basetrainer.engine.checkpoint import set_rng_state

            set_rng_state(self._pending_rng)
            self._pending_rng = None

    def _first_compiled_step(self, data: Any) -> Tuple[Any, Any]:
        try:
            result = self.run_step(data)
        except Exception as e:
            raise RuntimeError(f"torch.compile failed on the first step ({type(e).__name__}: {e}); "
                               f"set compile: false to train without it") from e
        self._compile_checked = True
        return result

    # ----------------------------------------------------------------------------- preemption
    def _install_signal_handlers(self) -> Dict[int, Any]:
        """SIGTERM/SIGINT: finish the current step, save a resumable checkpoint, exit non-zero."""
        import signal
        import threading

        self._preempted = None
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}

        def handler(signum: int, frame: Any) -> None:
            if self._preempted is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C stops at once
            self._preempted = signum
            logger.warning("received signal %d: stopping after this step and saving a checkpoint", signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                previous[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):  # not allowed here (e.g. embedded interpreters)
                pass
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: Dict[int, Any]) -> None:
        import signal

        for sig, old in previous.items():
            signal.signal(sig, old)

    def _stop_requested(self, batch: int) -> bool:
        """A signal asked to stop. One process: stop after this step. DDP: every rank must stop
        at the same step, so all ranks compare flags every ``log_freq`` steps (a signal that
        reached any rank stops them all)."""
        if comm.get_world_size() == 1:
            return self._preempted is not None
        return self.should_log(batch) and comm.any_true(self._preempted is not None)

    def on_preempt(self, epoch: int, batch: int) -> None:
        """Save a resumable checkpoint of this point (see :meth:`save_preempt_checkpoint`) and
        exit with status 128 + signal number."""
        path = self.save_preempt_checkpoint()
        signum = self._preempted or 15
        message = (f"training stopped by signal {signum} at epoch {epoch}, step {batch + 1}; "
                   + (f"checkpoint saved to {path}; resume with resume: auto (or --resume {path})"
                      if path else "no checkpoint was saved (no work_dir or ModelCheckpoint)"))
        logger.error("%s", message)
        raise SystemExit(message if comm.is_main_process() else 128 + signum)

    def save_preempt_checkpoint(self) -> Optional[str]:
        """Where a preempted run saves its state; the trainer writes ``last.pth``."""
        return None

    def restore(self) -> None:
        """Hook called at the start of :meth:`run`; the trainer restores ``resume`` here."""

    @property
    def unwrapped_model(self) -> nn.Module:
        """The model without DataParallel/DDP/compile wrappers (what checkpoints hold)."""
        return unwrap_model(self.model)
