"""What a recorder reads from a step: the phases it records, the model's outputs (a dict's
``output_key``, a tuple's first element) and the batch's targets (a dict's ``target_key``)."""
from typing import Any, Optional, Sequence, Tuple

from basetrainer.callbacks.callbacks import targets_of

PHASES = ("train", "test")


def check_phases(phases: Sequence[str]) -> Tuple[str, ...]:
    """``phases`` as a tuple of ``"train"``/``"test"`` (a single string is one phase).

    Raises:
        ValueError: no phase, or one of another name.
    """
    if isinstance(phases, str):
        phases = (phases,)
    phases = tuple(phases)
    if not phases or any(p not in PHASES for p in phases):
        raise ValueError(f"phases={phases!r}: choose one or both of {PHASES}")
    return phases


def pick_output(outputs: Any, output_key: Optional[str]) -> Any:
    """The tensor a metric reads from a model's outputs: ``outputs[output_key]`` of a dict
    (default ``"out"`` when present, as torchvision's segmentation models return, else the first
    value); the first element of a tuple or list; a tensor as it is."""
    if isinstance(outputs, dict):
        if output_key is not None:
            if output_key not in outputs:
                raise KeyError(f"output_key={output_key!r} is not in the model's outputs (keys: {sorted(outputs)}); "
                               f"set output_key to one of them")
            return outputs[output_key]
        return outputs["out"] if "out" in outputs else next(iter(outputs.values()))
    if output_key is not None:
        raise TypeError(f"output_key={output_key!r} needs dict outputs, but the model returned a "
                        f"{type(outputs).__name__}; leave output_key out")
    if isinstance(outputs, (list, tuple)):
        return outputs[0]
    return outputs


def pick_targets(inputs: Any, target_key: Optional[str]) -> Any:
    """``inputs[target_key]`` of a dict batch, else :func:`targets_of` (the second part of a
    ``(data, targets)`` batch, or a dict's ``targets``/``target``/``labels``/``label``)."""
    if target_key is None:
        return targets_of(inputs)
    if not isinstance(inputs, dict):
        raise TypeError(f"target_key={target_key!r} needs dict batches, but the batch is a {type(inputs).__name__}; "
                        f"leave target_key out to take the batch's second part")
    if target_key not in inputs:
        raise KeyError(f"target_key={target_key!r} is not in the batch (keys: {sorted(inputs)}); "
                       f"set target_key to one of them")
    return inputs[target_key]
