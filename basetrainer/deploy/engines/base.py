"""What every inference engine does the same way: inputs in, numpy outputs back, timing.

An engine takes a batch ``(N, C, H, W)`` as a numpy array or a torch tensor and returns a list
of numpy arrays, one per model output, each with the batch first (what the PyTorch model
returns). Runtimes that run one sample at a time (NCNN), and models exported with a fixed batch
of 1, are fed the samples in turn. ``quant`` says the precision to the runtime: 0 fp32, 1 fp16,
2 int8 where the runtime has it.
"""
import logging
from typing import Any, List, Optional, Sequence

import numpy as np

from basetrainer.deploy.latency import Latency, measure

logger = logging.getLogger(__name__)

QUANT = {0: "fp32", 1: "fp16", 2: "int8"}


def check_quant(quant: Any, engine: str, supported: Sequence[int] = (0, 1, 2)) -> int:
    if quant not in QUANT:
        raise ValueError(f"{engine}: quant={quant!r}; choose 0 (fp32), 1 (fp16) or 2 (int8)")
    if quant not in supported:
        raise ValueError(f"{engine} has no {QUANT[quant]} mode (quant={quant}); choose from "
                         f"{[f'{q} ({QUANT[q]})' for q in supported]}, or ONNXEngine(quant=2) for int8")
    return int(quant)


def as_batch(inputs: Any) -> np.ndarray:
    """``inputs`` as a C-contiguous float32 numpy array, batch first: ``(N, C, H, W)`` images, or
    ``(N, ...)`` for a model exported with another input shape."""
    if hasattr(inputs, "detach") and hasattr(inputs, "cpu"):   # a torch tensor
        inputs = inputs.detach().cpu().float().numpy()
    if not isinstance(inputs, np.ndarray):
        raise TypeError(f"inputs must be a numpy array or a torch tensor of shape (N, C, H, W), "
                        f"got {type(inputs).__name__}")
    if inputs.ndim < 2:
        raise ValueError(f"inputs of shape {tuple(inputs.shape)}: expected a batch, (N, C, H, W) for images; "
                         f"for one sample add the batch axis (x[None])")
    if inputs.shape[0] == 0:
        raise ValueError("inputs hold no sample (batch of 0)")
    return np.ascontiguousarray(inputs, dtype=np.float32)


class InferenceEngine:
    """The shared half of the engines; a runtime implements :meth:`_run`.

    Attributes:
        quant: the precision asked for (0 fp32, 1 fp16, 2 int8).
        dynamic: the model takes any batch size (``False``: the samples are fed one by one).
        input_shape: ``(C, H, W)`` (or the sizes of one input of another shape) the model takes,
            where the model file says (``None`` entries where it does not).
    """

    name = "engine"
    batched = True       # the runtime takes a whole batch in one call

    def __init__(self, quant: int = 0, dynamic: bool = True) -> None:
        self.quant = quant
        self.dynamic = bool(dynamic)
        self.input_shape: Optional[tuple] = None

    def __call__(self, inputs: Any) -> List[np.ndarray]:
        return self.forward(inputs)

    def forward(self, inputs: Any) -> List[np.ndarray]:
        """Run the batch ``inputs`` ``(N, C, H, W)``; a list of numpy outputs (batch first)."""
        batch = as_batch(inputs)
        self._check_shape(batch)
        if self.batched and self.dynamic:
            return self._run(batch)
        parts = [self._run(batch[i:i + 1]) for i in range(len(batch))]
        return [np.concatenate([p[k] for p in parts], axis=0) for k in range(len(parts[0]))]

    def _check_shape(self, batch: np.ndarray) -> None:
        want = self.input_shape
        if want and len(want) == batch.ndim and all(w in (None, -1) or w == g for w, g in zip(want, batch.shape)):
            axes = "(N, C, H, W)" if len(want) == 3 else f"(N, {', '.join('?' if w in (None, -1) else str(w) for w in want)})"
            raise ValueError(f"{self.name}: inputs of shape {tuple(batch.shape)}: expected {axes}, a batch; for one "
                             f"sample add the batch axis (x[None])")
        if want and (len(want) != batch.ndim - 1
                     or any(w not in (None, -1) and w != g for w, g in zip(want, batch.shape[1:]))):
            shown = tuple("?" if w in (None, -1) else w for w in want)
            fix = "resize the images to the size it was exported at" if len(want) == 3 else "give inputs of that shape"
            raise ValueError(f"{self.name}: inputs of shape {tuple(batch.shape)} do not fit the model, which takes "
                             f"(N, {', '.join(map(str, shown))}); {fix}")

    def _run(self, batch: np.ndarray) -> List[np.ndarray]:   # pragma: no cover - every engine has one
        raise NotImplementedError(f"{type(self).__name__} must implement _run")

    def performance(self, inputs: Any, iterate: int = 20, warmup: int = 3) -> Latency:
        """Latency of :meth:`forward` on ``inputs``: ``warmup`` untimed calls, then the median
        and spread of ``iterate`` timed ones (logged at info level, and returned)."""
        batch = as_batch(inputs)
        latency = measure(lambda: self.forward(batch), runs=iterate, warmup=warmup, batch=len(batch))
        logger.info("%s latency: %s", self.name, latency)
        return latency


def fall_back_to_cpu(engine: str, asked: str) -> None:
    logger.warning("%s: use_gpu=True but %s; running on the CPU", engine, asked)
