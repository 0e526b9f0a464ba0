"""How far an exported model is from eager PyTorch, and how far it may be.

An export is compared with the eager model on the same inputs (real images where given):
the largest absolute difference of any output value, the share of samples whose top-1 class
agrees, and, with labels, both accuracies. Each precision has a bound (:data:`BOUNDS`); an
export outside it is an error (:class:`ParityError`), never a warning.

The bounds, and why:

- **fp32** (ONNX Runtime, MNN, OpenVINO, NCNN with fp16 off): ``max |Δ| <= 1e-4`` and 100 % top-1
  agreement. The kernels differ from PyTorch's only in summation order and fused operations,
  which moves logits of a few units by about 1e-6; 1e-4 leaves room for deeper models and
  larger logits while still catching a wrong weight, layout or precision (fp16 storage gives
  3e-4 on the digits resnet18, bf16 8e-3).
- **fp16** (ONNX fp16, NCNN's default fp16 storage): ``max |Δ| <= 1e-2 x max |logit|`` and at
  least 99.5 % top-1 agreement. fp16 keeps 11 significant bits (a relative rounding of
  4.9e-4 per stored value); over ~20 layers the measured drift is 1e-4 to 1e-3 of the logit
  range, so 1e-2 of it holds with margin and a real error (a wrong layout) is far outside.
- **int8** (ONNX Runtime static quantization): the accuracy on labelled images may drop by at
  most 1 point; without labels, at least 97 % top-1 agreement.
"""
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np


class ParityError(ValueError):
    """An export disagrees with the eager model beyond its format's bound."""


@dataclass(frozen=True)
class Bound:
    max_abs: Optional[float] = None          # absolute bound on max |Δ output|
    rel: Optional[float] = None              # bound on max |Δ| / max |reference|
    min_agreement: Optional[float] = None    # share of samples with the same top-1
    max_accuracy_drop: Optional[float] = None   # with labels: accuracy(eager) - accuracy(export)
    unlabelled_agreement: Optional[float] = None   # used instead of max_accuracy_drop without labels

    def describe(self) -> str:
        parts = []
        if self.max_abs is not None:
            parts.append(f"max|Δ| ≤ {self.max_abs:g}")
        if self.rel is not None:
            parts.append(f"max|Δ| ≤ {self.rel:g}·max|logit|")
        if self.min_agreement is not None:
            parts.append(f"top-1 ≥ {self.min_agreement:.1%}")
        if self.max_accuracy_drop is not None:
            parts.append(f"accuracy drop ≤ {self.max_accuracy_drop * 100:g} pt")
        return ", ".join(parts)


BOUNDS: Dict[str, Bound] = {
    "fp32": Bound(max_abs=1e-4, min_agreement=1.0),
    "fp16": Bound(rel=1e-2, min_agreement=0.995),
    "int8": Bound(max_accuracy_drop=0.01, unlabelled_agreement=0.97),
}


@dataclass
class Parity:
    """The comparison of an export with the eager model on ``samples`` inputs."""
    samples: int
    max_abs: float
    max_reference: float
    agreement: float
    accuracy_reference: Optional[float] = None
    accuracy: Optional[float] = None
    batch_max_abs: Optional[float] = None    # per-sample results at batch 1 vs batch N

    @property
    def accuracy_drop(self) -> Optional[float]:
        if self.accuracy is None or self.accuracy_reference is None:
            return None
        return self.accuracy_reference - self.accuracy

    def as_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "accuracy_drop": self.accuracy_drop}


def top1(outputs: np.ndarray) -> np.ndarray:
    """The class index of every sample (over axis 1; per position for dense outputs)."""
    return np.asarray(outputs).argmax(axis=1) if np.ndim(outputs) >= 2 else np.asarray(outputs)


def compare(reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray],
            labels: Optional[np.ndarray] = None) -> Parity:
    """Compare every output; top-1 and accuracy are read from the first one."""
    if len(reference) != len(outputs):
        raise ParityError(f"the export has {len(outputs)} outputs, the model {len(reference)}")
    worst, scale = 0.0, 0.0
    for k, (ref, out) in enumerate(zip(reference, outputs)):
        ref, out = np.asarray(ref, dtype=np.float64), np.asarray(out, dtype=np.float64)
        if ref.shape != out.shape:
            raise ParityError(f"output {k} has shape {out.shape} in the export and {ref.shape} in the model")
        if not np.all(np.isfinite(out)):
            return Parity(len(ref), float("inf"), float(np.abs(ref).max()), 0.0)
        worst = max(worst, float(np.abs(ref - out).max()))
        scale = max(scale, float(np.abs(ref).max()))
    ref_top, out_top = top1(reference[0]), top1(outputs[0])
    agreement = float(np.mean(ref_top == out_top))
    parity = Parity(len(reference[0]), worst, scale, agreement)
    if labels is not None:
        labels = np.asarray(labels)
        parity.accuracy_reference = float(np.mean(ref_top == labels))
        parity.accuracy = float(np.mean(out_top == labels))
    return parity


def failures(parity: Parity, bound: Bound) -> List[str]:
    """What of ``parity`` is outside ``bound`` (empty: the export passes)."""
    found = []
    if bound.max_abs is not None and not parity.max_abs <= bound.max_abs:
        found.append(f"max |Δ output| {parity.max_abs:.3g} > {bound.max_abs:g}")
    if bound.rel is not None and not parity.max_abs <= bound.rel * max(parity.max_reference, 1e-12):
        found.append(f"max |Δ output| {parity.max_abs:.3g} > {bound.rel:g} x max |output| "
                     f"{parity.max_reference:.3g}")
    if bound.min_agreement is not None and parity.agreement < bound.min_agreement:
        found.append(f"top-1 agreement {parity.agreement:.2%} < {bound.min_agreement:.1%}")
    if bound.max_accuracy_drop is not None:
        drop = parity.accuracy_drop
        if drop is not None and drop > bound.max_accuracy_drop + 1e-12:
            found.append(f"accuracy {parity.accuracy:.2%} is {drop * 100:.2f} points below eager "
                         f"{parity.accuracy_reference:.2%} (bound {bound.max_accuracy_drop * 100:g})")
        if drop is None and bound.unlabelled_agreement is not None and parity.agreement < bound.unlabelled_agreement:
            found.append(f"top-1 agreement {parity.agreement:.2%} < {bound.unlabelled_agreement:.1%} (no labels)")
    return found
