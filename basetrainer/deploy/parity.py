"""How far an exported model is from eager PyTorch, and how far it may be.

An export is compared with the eager model on the same inputs (real images where given), output
by output. One rule holds for every output, whatever it holds (class scores, boxes, a regression
value, a segmentation map):

    max |Δ| of output k  <=  rel x scale of the model's output k       (rel: :data:`BOUNDS`)

and, where an output holds class scores, the share of samples whose top-1 class agrees (with
labels, both accuracies). An export outside its bound is an error (:class:`ParityError`), never a
warning. Which outputs hold class scores is said, not guessed from a shape (a regression of two
values is ``[N, 2]`` too): see :func:`find_class_outputs`.

**Relative, not absolute.** What an export gets wrong scales with the values it computes: float
rounding is relative, and an int8 step is a share of the range it quantizes. An absolute 1e-4
refused a correct fp32 export whose logits reached 301 (max |Δ| 1.37e-4, 4.6e-7 of the largest
logit) and let anything pass on an output of 0.01; top-1 agreement told nothing of an output of
one column (always 100 %), so an int8 regression off by 1.68 where its outputs spread by 0.10
was published.

**The scale: the standard deviation, at least a tenth of the RMS.** Measured on the finite
values of the model's output over the check inputs:

- not the largest value: one extreme sample loosens the bound of every other, and the largest
  value grows with the number of check images (the logits below: max 4.3 to 5.3 x their std);
- the deviation, not the RMS, because a disagreement is measured against how much the output
  varies, not against its offset: int8 calibrated on inputs at 5 % of their range put a
  regression of 3 ± 0.1 off by 0.27: 9 % of its RMS (2.98), 2.3 times its spread (0.117);
- at least a tenth of the RMS, because rounding follows the magnitude, offset included (one
  fp32 step at 1000 is 6e-5, 6e-4 of the deviation of 1000 ± 0.1), and one value (a batch of 1,
  one column) or a constant output has no deviation. The scale is 0 only for an output that is all
  zeros, which the export must give as zeros.

Measured max |Δ| / scale (CPU, 2026-11-27; fp32 is ONNX Runtime, MNN, OpenVINO and NCNN):

- resnet18 at 32x32 after 2 epochs (91.9 %; logits on 120 digits validation images): fp32
  1.7e-6 to 4.2e-6; fp16 4.4e-4 (ONNX), 2.6e-4 (NCNN); int8 2.9e-2 (99.2 % of top-1 kept);
  MNN with fp16 weights 1.6e-2.
- the issue's pruned resnet18 at 16x16 after 1 epoch (logits up to 115): fp32 2.3e-6 to 4.8e-6;
  fp16 1.2e-3; int8 0.17 (every top-1 kept); MNN with fp16 weights 2.2e-2.
- regressions [N, 1] of spread 0.1 (a small CNN; an untrained resnet18): fp32 up to 8.6e-6,
  fp16 3.8e-3; int8 calibrated on inputs like the check's 0.03 to 0.14, calibrated on grey
  images or on inputs at 5 % of their range 0.9 to 4.1 (the issue's: 1.68 / 0.10 = 17).

So the bounds:

- **fp32** (ONNX Runtime, MNN, OpenVINO, NCNN with fp16 off): ``rel = 1e-4`` (12x the largest
  fp32 figure; fp16 arithmetic, 2.6e-4 and up, is outside), and 100 % top-1 agreement.
- **fp16** (ONNX fp16, NCNN's fp16 storage): ``rel = 5e-2`` (about the former 1 % of the largest
  logit, 4.3 to 5.3 x their scale), and at least 99.5 % top-1 agreement.
- **int8** (ONNX Runtime static quantization): ``rel = 0.25`` on every output but class scores,
  which int8 moves by design (0.17 with every top-1 kept): those are judged by what they decide,
  the accuracy on labelled images dropping by at most 1 point, or without labels at least 97 %
  of the top-1 classes agreeing. And the same 0.25 on each slice of an output along axis 1 and
  along its last axis (a column, a channel, a feature: :func:`relative`), each slice's scale at
  least 1 % of the output's: int8 quantizes a tensor with one step, so a column of small spread
  beside columns of large values is lost in it (a probability beside box coordinates in pixels
  came out 0.42 off, ten times its spread, at 0.029 of the output's scale). fp32 and fp16 keep
  each value's relative precision, and a slice's own scale would judge their rounding, set by
  the magnitudes the slice was computed from, against a spread that may be near zero (one value
  of a batch of 1, a column of nearly constant logits).

A value that is not finite must be the same in the export (NaN where the model gives NaN, the
same infinity); anywhere else it is an infinite difference.
"""
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np


class ParityError(ValueError):
    """An export disagrees with the eager model beyond its format's bound."""


@dataclass(frozen=True)
class Bound:
    """What an export of one precision must meet."""
    rel: float                                     # per output: max |Δ| <= rel x scale(reference)
    min_agreement: Optional[float] = None          # class scores: share of samples with the same top-1
    max_accuracy_drop: Optional[float] = None      # class scores, labelled: accuracy(eager) - accuracy(export)
    unlabelled_agreement: Optional[float] = None   # class scores, no labels: instead of max_accuracy_drop
    rel_on_scores: bool = True                     # False: class scores are judged by top-1 / accuracy only
    part_floor: Optional[float] = None             # also each slice, its scale >= this x the output's (relative())

    def describe(self, classes: bool = True) -> str:
        """The bound in words; ``classes``: the model has class-score outputs (else the top-1 and
        accuracy parts, which do not apply, are left out)."""
        parts = [f"max|Δ| ≤ {self.rel:g}·scale per output"
                 + (" and per column or channel" if self.part_floor is not None else "")
                 + ("" if self.rel_on_scores or not classes else " but class scores")]
        if classes and self.min_agreement is not None:
            parts.append(f"top-1 ≥ {self.min_agreement:.1%}")
        if classes and self.max_accuracy_drop is not None:
            parts.append(f"accuracy drop ≤ {self.max_accuracy_drop * 100:g} pt")
        if classes and self.unlabelled_agreement is not None:
            parts.append(f"without labels top-1 ≥ {self.unlabelled_agreement:.0%}")
        return ", ".join(parts)


BOUNDS: Dict[str, Bound] = {
    "fp32": Bound(rel=1e-4, min_agreement=1.0),
    "fp16": Bound(rel=5e-2, min_agreement=0.995),
    "int8": Bound(rel=0.25, max_accuracy_drop=0.01, unlabelled_agreement=0.97, rel_on_scores=False,
                  part_floor=0.01),
}
SPREAD_FLOOR = 0.1   # the scale is at least this share of the RMS (see the module docstring)
PART_MIN_VALUES = 8  # a slice is judged by its own scale when it holds at least this many values


@dataclass
class OutputParity:
    """One output of the export against the same output of the model."""
    name: str
    shape: Tuple[int, ...]
    max_abs: float                          # max |Δ| over the finite values (inf: non-finite where the model is not)
    scale: float                            # scale() of the model's whole output
    agreement: Optional[float] = None       # class scores only: share of samples (positions) with the same top-1
    nonfinite_reference: int = 0            # NaN/inf values in the model's output
    part_rel: float = 0.0                   # max |Δ| / scale of the slice furthest off (see relative())
    part_abs: float = 0.0                   # its max |Δ|
    part_scale: float = 0.0                 # its scale
    part: str = ""                          # that slice: "[:, 4]" (index 4 of axis 1), "[..., 2]" (of the last axis)

    @property
    def rel(self) -> float:
        """The larger of ``max_abs / scale`` (the whole output) and ``part_rel`` (its slice
        furthest off); inf where a scale is 0 and the export differs."""
        if self.max_abs == 0:
            return 0.0
        return max(self.max_abs / self.scale if self.scale > 0 else math.inf, self.part_rel)


@dataclass
class Parity:
    """The comparison of an export with the eager model on ``samples`` inputs."""
    samples: int
    outputs: List[OutputParity] = field(default_factory=list)
    accuracy_reference: Optional[float] = None
    accuracy: Optional[float] = None
    batch_max_abs: Optional[float] = None    # per-sample results at batch 1 vs batch N

    @property
    def max_abs(self) -> float:
        """The largest absolute difference over every output."""
        return max((o.max_abs for o in self.outputs), default=0.0)

    @property
    def worst(self) -> Optional[OutputParity]:
        """The output furthest from the model relative to its scale."""
        return max(self.outputs, key=lambda o: o.rel, default=None)

    @property
    def agreement(self) -> Optional[float]:
        """Top-1 agreement of the class-score outputs (the lowest); ``None`` when there are none."""
        found = [o.agreement for o in self.outputs if o.agreement is not None]
        return min(found) if found else None

    @property
    def accuracy_drop(self) -> Optional[float]:
        if self.accuracy is None or self.accuracy_reference is None:
            return None
        return self.accuracy_reference - self.accuracy

    def as_dict(self) -> Dict[str, Any]:
        worst = self.worst
        return {"samples": self.samples, "max_abs": self.max_abs, "rel": worst.rel if worst else 0.0,
                "worst_output": worst.name if worst else None, "agreement": self.agreement,
                "accuracy_reference": self.accuracy_reference, "accuracy": self.accuracy,
                "accuracy_drop": self.accuracy_drop, "batch_max_abs": self.batch_max_abs,
                "outputs": [{**asdict(o), "rel": o.rel} for o in self.outputs]}


def top1(outputs: np.ndarray) -> np.ndarray:
    """The class index of every sample (over axis 1; per position for dense outputs)."""
    return np.asarray(outputs).argmax(axis=1)


def scale(values: np.ndarray) -> float:
    """The scale an output's differences are measured against: the standard deviation of its
    finite values, but at least :data:`SPREAD_FLOOR` of their root mean square (0 when there are
    none, or all are 0)."""
    finite = np.asarray(values, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    if not finite.size:
        return 0.0
    return float(max(finite.std(), SPREAD_FLOOR * np.sqrt(np.mean(finite ** 2))))


def relative(reference: np.ndarray, output: np.ndarray, floor: float = 0.0) -> Tuple[float, float, float, str]:
    """``(rel, max |Δ|, scale, part)`` of the slice of an output furthest from the model relative
    to its own scale: the slices along axis 1 and along the last axis (a column, a channel, a
    feature) of an output ``[N, ...]`` that hold at least :data:`PART_MIN_VALUES` values (fewer
    tell no spread), each slice's scale (:func:`scale`) at least ``floor`` x the whole output's.
    ``part`` names the slice (``"[:, 4]"``: index 4 of axis 1; ``"[..., 2]"``: of the last axis);
    ``(0, 0, 0, "")`` when no slice is judged. Only pairs of finite values count (see
    :func:`max_difference` for the others); ``rel`` is inf where a slice's scale is 0 and the
    export differs there.

    Why: a slice's values share a meaning and a unit, an output's need not. An ``[N, 5]`` output
    of four box coordinates in pixels (0 to 300) and a probability has a scale of 62, and int8,
    which quantizes the whole tensor with one step, put the probability off by 0.42, ten times its
    spread (0.044): 0.029 of the output's scale, published. By itself it is 8.9.
    """
    ref, out = np.asarray(reference, dtype=np.float64), np.asarray(output, dtype=np.float64)
    if ref.ndim < 2 or ref.size == 0:
        return 0.0, 0.0, 0.0, ""
    finite = np.isfinite(ref) & np.isfinite(out)
    least = floor * scale(ref)
    worst: Tuple[float, float, float, str] = (0.0, 0.0, 0.0, "")
    for axis in sorted({1, ref.ndim - 1}):
        size = ref.shape[axis]
        r, o, f = (np.moveaxis(a, axis, 0).reshape(size, -1) for a in (ref, out, finite))
        count = f.sum(axis=1)
        values = np.where(f, r, 0.0)
        mean = values.sum(axis=1) / np.maximum(count, 1)
        std = np.sqrt(np.where(f, (r - mean[:, None]) ** 2, 0.0).sum(axis=1) / np.maximum(count, 1))
        rms = np.sqrt((values ** 2).sum(axis=1) / np.maximum(count, 1))
        scales = np.maximum(np.maximum(std, SPREAD_FLOOR * rms), least)
        diffs = np.where(f, np.abs(r - o), 0.0).max(axis=1)
        judged = (count >= PART_MIN_VALUES) & (diffs > 0)
        rels = np.where(judged, np.inf, 0.0)
        scaled = judged & (scales > 0)
        rels[scaled] = diffs[scaled] / scales[scaled]
        k = int(np.argmax(rels))
        if rels[k] > worst[0]:
            worst = (float(rels[k]), float(diffs[k]), float(scales[k]), f"[:, {k}]" if axis == 1 else f"[..., {k}]")
    return worst


def max_difference(reference: np.ndarray, output: np.ndarray) -> float:
    """max |reference - output| over the finite values; inf where one is not finite and the
    other is not the same (NaN and NaN, or the same infinity, are equal)."""
    ref, out = np.asarray(reference, dtype=np.float64), np.asarray(output, dtype=np.float64)
    finite = np.isfinite(ref) & np.isfinite(out)
    same = ~finite & ((ref == out) | (np.isnan(ref) & np.isnan(out)))
    if not np.all(finite | same):
        return math.inf
    return float(np.abs(ref[finite] - out[finite]).max()) if finite.any() else 0.0


def find_class_outputs(reference: Sequence[np.ndarray], declared: Optional[Sequence[int]] = None,
                       num_classes: Optional[int] = None, check_classes: Optional[int] = None) -> Tuple[int, ...]:
    """The outputs that hold class scores (axis 1 over the classes): top-1 agreement and accuracy
    are read from these, and only these.

    Args:
        reference: the model's outputs, batch first.
        declared: the indices the user gives (``[]``: none); wins over the rest.
        num_classes: the class count the user gives or the checkpoint's run trained with: the
            outputs with that many entries on axis 1 (at least 2).
        check_classes: the class count of the check ImageFolder, used when ``num_classes`` is not
            known: the first output, when it has that many entries on axis 1.

    Without any of these no output is taken for class scores (a shape alone does not say it: a
    regression of two values is ``[N, 2]`` too).

    Raises:
        ValueError: a declared index that is no output, or an output without a class axis; a check
            folder whose class count is not the width of the class scores it labels (or, with nothing
            said, of a first output ``[N, C]``).
    """
    if declared is not None and not isinstance(declared, (list, tuple)):
        raise ValueError(f"class_outputs={declared!r} must be a list of output indices, e.g. [0] ([] for none)")
    shapes = [np.shape(r) for r in reference]
    scores = [k for k, s in enumerate(shapes) if len(s) >= 2 and s[1] >= 2]
    if declared is not None:
        bad = [k for k in declared if not isinstance(k, (int, np.integer)) or k not in scores]
        if bad:
            raise ValueError(f"class_outputs={list(declared)!r}: {bad} {'is' if len(bad) == 1 else 'are'} not an "
                             f"output with class scores on axis 1 (the model's outputs have shapes {shapes}); pass the "
                             f"indices of [N, classes, ...] outputs, or [] for none (--class-outputs none)")
        found = tuple(int(k) for k in dict.fromkeys(declared))
    elif num_classes:
        found = tuple(k for k in scores if shapes[k][1] == num_classes)
    else:   # a check folder's labels say that the first output, if any, scores its classes
        found = (0,) if check_classes and 0 in scores and shapes[0][1] == check_classes else ()
    # the labels of a check folder are read from the first [N, C] class output: C must be its class
    # count (and, with nothing said, a first output [N, C] is taken to be meant as class scores)
    labelled = [k for k in found if len(shapes[k]) == 2]
    unsaid = declared is None and num_classes is None and len(shapes[0]) == 2 and shapes[0][1] >= 2
    k = labelled[0] if labelled else (0 if unsaid else None)
    if check_classes and k is not None and shapes[k][1] != check_classes:
        raise ValueError(f"the check folder has {check_classes} classes and the model's output {k} has "
                         f"{shapes[k][1]} columns; pass the validation folder of the run that trained it, or, if "
                         f"the model's outputs are not class scores, class_outputs=[] (--class-outputs none)")
    return found


def compare(reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray], labels: Optional[np.ndarray] = None,
            classes: Sequence[int] = (), names: Optional[Sequence[str]] = None,
            part_floor: Optional[float] = None) -> Parity:
    """Compare every output; top-1 agreement on the ``classes`` outputs, accuracy (with
    ``labels``, one per sample) on the first of them that is ``[N, classes]``; with
    ``part_floor`` (a :class:`Bound`'s), also the slices of each output but class scores
    (:func:`relative`).

    Raises:
        ParityError: the export has another number of outputs, or an output of another shape.
    """
    if len(reference) != len(outputs):
        raise ParityError(f"the export has {len(outputs)} outputs, the model {len(reference)}")
    if not names or len(names) != len(reference):
        names = [str(k) for k in range(len(reference))]
    parity = Parity(len(reference[0]) if len(reference) else 0)
    for k, (ref, out) in enumerate(zip(reference, outputs)):
        ref, out = np.asarray(ref), np.asarray(out)
        if ref.shape != out.shape:
            raise ParityError(f"output {names[k]!r} has shape {out.shape} in the export and {ref.shape} in the model")
        agreement = float(np.mean(top1(ref) == top1(out))) if k in classes else None
        nonfinite = int(np.size(ref) - np.count_nonzero(np.isfinite(ref)))
        parity.outputs.append(OutputParity(str(names[k]), tuple(ref.shape), max_difference(ref, out), scale(ref),
                                           agreement, nonfinite,
                                           *(relative(ref, out, part_floor) if part_floor is not None
                                             and agreement is None else ())))
    labelled = [k for k in classes if np.ndim(reference[k]) == 2]
    if labels is not None and labelled:
        labels = np.asarray(labels)
        parity.accuracy_reference = float(np.mean(top1(reference[labelled[0]]) == labels))
        parity.accuracy = float(np.mean(top1(outputs[labelled[0]]) == labels))
    return parity


def failures(parity: Parity, bound: Bound) -> List[str]:
    """What of ``parity`` is outside ``bound`` (empty: the export passes)."""
    found = []
    several = len(parity.outputs) > 1
    for o in parity.outputs:
        what = f"output {o.name!r}: " if several else ""
        if math.isinf(o.max_abs):
            found.append(f"{what}NaN or infinity in the export where the model's value is another")
        elif not bound.rel_on_scores and o.agreement is not None:
            pass   # class scores judged by what they decide (below)
        elif not o.max_abs <= bound.rel * o.scale:
            of = f"scale {o.scale:.3g}" if o.scale > 0 else "an output that is all zeros in the model"
            whole = o.max_abs / o.scale if o.scale > 0 else math.inf
            found.append(f"{what}max |Δ| {o.max_abs:.3g} > {bound.rel:g} x {of} (relative {whole:.2g})")
        elif not o.part_rel <= bound.rel:   # within the output's scale, but not one slice within its own
            of = f"its scale {o.part_scale:.3g}" if o.part_scale > 0 else "values that are all zeros in the model"
            found.append(f"{what}max |Δ| {o.part_abs:.3g} at {o.part} > {bound.rel:g} x {of} "
                         f"(relative {o.part_rel:.2g})")
        if o.agreement is not None and bound.min_agreement is not None and o.agreement < bound.min_agreement:
            found.append(f"{what}top-1 agreement {o.agreement:.2%} < {bound.min_agreement:.1%}")
    if bound.max_accuracy_drop is not None and parity.agreement is not None:
        drop = parity.accuracy_drop
        if drop is not None and drop > bound.max_accuracy_drop + 1e-12:
            found.append(f"accuracy {parity.accuracy:.2%} is {drop * 100:.2f} points below eager "
                         f"{parity.accuracy_reference:.2%} (bound {bound.max_accuracy_drop * 100:g})")
        if drop is None and bound.unlabelled_agreement is not None and parity.agreement < bound.unlabelled_agreement:
            found.append(f"top-1 agreement {parity.agreement:.2%} < {bound.unlabelled_agreement:.1%} (no labels)")
    return found
