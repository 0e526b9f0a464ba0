"""An exponential moving average of the weights, used for evaluation.

Not ``torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))``,
though its average is the same, to the bit (primed with the starting weights, then one
``_foreach_lerp_`` per step, as here): measured on torch 2.14, it costs 439 Python calls per
optimizer step on a 5-layer model where this costs 3 (it regroups the model's tensors by device
and dtype every step), it keeps a deep copy of the module, and under fsdp that copy is refused
("FSDP does not support deepcopy"), where this holds the average as DTensor shards of the
state dict, one shard per rank, gathered only for the weights files. Under fsdp the buffers
(BatchNorm statistics) are plain tensors beside the DTensor shards, and the same on every rank
(:func:`basetrainer.runtime.sharding.buffer_sync`), so their average is a plain tensor too: one
``_foreach_lerp_`` per kind of tensor (torch refuses a list mixing the two).
"""
from typing import Any, Dict, List, Optional, Tuple

import torch

from basetrainer.callbacks.callbacks import Callback
from basetrainer.runtime import comm
from basetrainer.runtime.modules import unwrap_model


class ModelEMA(Callback):
    """Keeps ``ema = decay * ema + (1 - decay) * weights`` after every optimizer step (all float
    tensors of the state_dict, BatchNorm statistics included). With ``evaluate=True`` the test
    phase runs on the averaged weights (they are swapped in at ``on_test_begin`` and back at
    ``on_test_end``, wherever it stands in the callback list), so every test figure is the
    average's; ``trainer.evaluate()`` too, but ``evaluate(checkpoint=...)`` tests the weights of
    that file. The average is part of the checkpoint (``state_dict``) and is resumed.

    A ModelCheckpoint whose indicator is a test figure then writes the average in its weights
    files (``best_model_<epoch>_<value>.pth``, ``model_<epoch>_<value>.pth``): a file holds the
    weights that gave the figure in its name. ``last.pth`` holds the live weights (training goes
    on from them) with the average beside them. A train figure (``train/loss``) is the live
    model's, and its files hold the live weights. At most one ModelEMA may evaluate.

    Args:
        decay: the averaging factor per optimizer step, in [0, 1).
        evaluate: evaluate with the averaged weights.

    Example::

        callbacks = [LossesRecorder(), AccuracyRecorder(), ModelEMA(decay=0.999),
                     ModelCheckpoint(model_dir=..., indicator="Accuracy")]   # best file: the average
    """

    def __init__(self, decay: float = 0.999, evaluate: bool = True) -> None:
        super().__init__()
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay={decay!r} must be in [0, 1)")
        self.decay = decay
        self.evaluate = evaluate
        self.ema: Optional[Dict[str, torch.Tensor]] = None
        self._groups: List[Tuple[List[torch.Tensor], List[torch.Tensor]]] = []   # (averages, live) per kind
        self._backup: Optional[Dict[str, torch.Tensor]] = None
        self._step = -1

    def _model(self) -> torch.nn.Module:
        return unwrap_model(self.trainer.model)

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        evaluating = [c for c in getattr(self.trainer, "callbacks", None) or []
                      if isinstance(c, ModelEMA) and c.evaluate]
        if self.evaluate and len(evaluating) > 1:
            raise ValueError(f"{len(evaluating)} ModelEMA callbacks evaluate (decay "
                             f"{', '.join(str(c.decay) for c in evaluating)}): the test phase runs on one set of "
                             f"weights (the second swapped in over the first, and put the first's average back into "
                             f"the model after the test); give all but one evaluate=False")
        state = self._model().state_dict()
        if self.ema is None:
            self.ema = {k: v.detach().clone() for k, v in state.items()}
        else:  # resumed: on the model's device, sharded like it (a one-file checkpoint under fsdp)
            self.ema = {k: _like(self.ema[k], v) for k, v in state.items()}
        kinds: Dict[bool, Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}
        for k, v in state.items():
            if v.is_floating_point():   # DTensor shards (fsdp's parameters) apart from plain tensors (buffers)
                avg, live = kinds.setdefault(_is_sharded(v), ([], []))
                avg.append(self.ema[k])
                live.append(v)
        self._groups = list(kinds.values())
        self._step = self.trainer.global_step

    def on_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self.trainer.global_step == self._step:  # accumulating: no optimizer step yet
            return
        self._step = self.trainer.global_step
        for avg, live in self._groups:
            torch._foreach_lerp_(avg, live, 1.0 - self.decay)

    def on_test_begin(self, logs: Optional[dict] = None) -> None:
        # evaluate(checkpoint=...) tests that file's weights, not this run's average over them
        if self.evaluate and self.ema is not None and not getattr(self.trainer, "evaluating_checkpoint", None):
            model = self._model()
            self._backup = {k: v.detach().clone() for k, v in model.state_dict().items()}
            model.load_state_dict(self.ema)
            if getattr(self.trainer, "evaluating", False):   # evaluate()/predict(): the live weights back also when it raises
                self.trainer.at_evaluation_end(lambda: self.on_test_end())

    def on_test_end(self, logs: Optional[dict] = None) -> None:
        if self._backup is not None:
            self._model().load_state_dict(self._backup)
            self._backup = None

    def on_predict_begin(self, logs: Optional[dict] = None) -> None:
        self.on_test_begin(logs)   # predict() runs on the weights evaluate() tests

    def on_predict_end(self, logs: Optional[dict] = None) -> None:
        self.on_test_end(logs)

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        self.on_test_end(logs)  # never leave the averaged weights in the model by accident

    def test_weights(self) -> Optional[Dict[str, torch.Tensor]]:
        """The weights the test phase runs on: the average, as a state dict of whole tensors
        (under fsdp the shards are gathered: a collective, every rank calls it; the main
        process gets the dict, the others an empty one). None with ``evaluate=False`` (the test
        phase runs on the live weights) or before training. Live tensors outside fsdp: copy them
        before training goes on."""
        if not self.evaluate or self.ema is None:
            return None
        main = comm.is_main_process()
        out = {}
        for key, value in self.ema.items():
            if hasattr(value, "full_tensor"):   # a DTensor shard (fsdp)
                value = value.full_tensor()
            if main:
                out[key] = value.detach()
        return out

    def state_dict(self) -> Dict[str, Any]:
        # evaluate: which average the test figures (and the weights files) are of, for an export
        # of a checkpoint holding several (weights="ema")
        return {"decay": self.decay, "evaluate": self.evaluate, "ema": self.ema or {}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.ema = dict(state["ema"]) if state.get("ema") else None


def _is_sharded(value: torch.Tensor) -> bool:
    """Whether ``value`` is a DTensor (a shard of an fsdp model's parameter)."""
    return getattr(value, "device_mesh", None) is not None


def _like(saved: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """``saved`` on ``live``'s device, and sharded like it when ``live`` is a DTensor (FSDP)."""
    if _is_sharded(live) and not _is_sharded(saved):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(saved.to(live.device), live.device_mesh, live.placements)
    return saved.to(live.device)
