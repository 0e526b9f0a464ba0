"""What a recorder reads from a step: the model's outputs (a dict's ``output_key``, a tuple's
first element) and the batch's targets (a dict's ``target_key``), and what a metric's
``update`` takes of them."""
import inspect
from typing import Any, Callable, Optional, Sequence, Tuple

from basetrainer.callbacks.callbacks import targets_of


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


# ----------------------------------------------------------------------------- what an update takes
READS = ("outputs", "targets")


def update_arity(metric: Any) -> Optional[Tuple[int, int]]:
    """``(required, most)`` positional arguments of ``metric.update`` (torchmetrics' wrappers,
    whose update takes ``*args``, answer for the metric they wrap); None when it cannot be told."""
    try:
        params = list(inspect.signature(metric.update).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        inner = getattr(metric, "base_metric", None) or getattr(metric, "metric", None)
        return update_arity(inner) if inner is not None and hasattr(inner, "update") else None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return sum(p.default is p.empty for p in positional), len(positional)


def update_signature(metric: Any) -> str:
    """``"MaxMetric.update(value)"``; optional arguments in brackets."""
    try:
        params = [p for p in inspect.signature(metric.update).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    except (TypeError, ValueError):
        params = []
    names = [f"*{p.name}" if p.kind is p.VAR_POSITIONAL else p.name if p.default is p.empty else f"[{p.name}]"
             for p in params]
    return f"{type(metric).__name__}.update({', '.join(names)})"


def inputs_taken(arity: Optional[Tuple[int, int]]) -> Optional[int]:
    """How many of (outputs, targets) an update of ``arity`` takes: 1, 2, or None (neither: it
    needs a transform). An update whose arguments cannot be told takes both, as torchmetrics'
    ``(preds, target)`` metrics do."""
    if arity is None:
        return 2
    required, most = arity
    if required == 1 or (required == 0 and most == 1):
        return 1
    if required == 2 or (required == 0 and most >= 2):
        return 2
    return None


def update_driver(members: Sequence[Tuple[str, Any]], label: str, reads: Optional[str],
                  transform: Optional[Callable[[Any, Any], Any]]) -> Callable[[Any, Any], Tuple[Any, ...]]:
    """``args(preds, targets)``: the arguments a recorder passes to the update of a metric whose
    members are ``members`` (``[(name, Metric)]``), checked now, when the recorder is built.

    A metric whose update takes one input gets the outputs (``reads="targets"``: the targets);
    one that takes two gets ``(outputs, targets)``; ``transform(outputs, targets)`` returns the
    arguments itself (a tuple is several, anything else one).

    Raises:
        ValueError: ``reads`` is not ``"outputs"``/``"targets"``, is given with ``transform``, or
            for a metric that takes two inputs; a collection mixes one- and two-input members.
        TypeError: the update takes neither one nor two inputs and there is no ``transform``.
    """
    if reads is not None and reads not in READS:
        raise ValueError(f"{label}: reads={reads!r}; a one-input metric reads 'outputs' or 'targets' "
                         f"(or give transform=lambda outputs, targets: value)")
    if reads is not None and transform is not None:
        raise ValueError(f"{label}: reads={reads!r} and transform are given; the transform's return is what the "
                         f"update takes: give one of them, not both")
    for name, m in members:   # the recorder passes positional arguments only
        try:
            keywords = [p.name for p in inspect.signature(m.update).parameters.values()
                        if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
        except (TypeError, ValueError):
            keywords = []
        if keywords:
            raise TypeError(f"{label}: {update_signature(m)} also requires the keyword argument(s) "
                            f"{', '.join(keywords)}, which MetricRecorder cannot pass (it calls update with "
                            f"positional arguments): make them positional or give them a default, or record the "
                            f"figure with a FunctionRecorder")
    arities = [(name, m, update_arity(m)) for name, m in members]
    taken = {name: inputs_taken(arity) for name, m, arity in arities}
    if transform is not None:
        def with_transform(preds: Any, targets: Any) -> Tuple[Any, ...]:
            args = transform(preds, targets)
            args = args if isinstance(args, tuple) else (args,)
            for name, m, arity in arities:
                if arity is not None and not arity[0] <= len(args) <= arity[1]:
                    raise TypeError(f"{label}: transform returned {len(args)} value{'s' * (len(args) != 1)}; "
                                    f"{update_signature(m)} takes {_count(arity)}: return "
                                    f"{'one value' if arity[1] == 1 else 'a tuple of its arguments'}")
            return args
        return with_transform
    cannot = [(name, m) for name, m, _ in arities if taken[name] is None]
    if cannot:
        name, m = cannot[0]
        raise TypeError(f"{label}: {update_signature(m)} takes {_count(update_arity(m))}; MetricRecorder passes "
                        f"the model's outputs and the batch's targets: give transform=lambda outputs, targets: "
                        f"(...) returning its arguments, or record the figure with a FunctionRecorder")
    kinds = set(taken.values())
    if len(kinds) > 1:
        one = [repr(n) for n, k in taken.items() if k == 1]
        two = [repr(n) for n, k in taken.items() if k == 2]
        raise ValueError(f"{label}: the MetricCollection's members {', '.join(one)} take one input and "
                         f"{', '.join(two)} two (outputs, targets); put the one-input metrics in their own "
                         f"MetricRecorder (with reads= 'outputs' or 'targets')")
    if kinds == {2}:
        if reads is not None:
            name, m, arity = arities[0]
            raise ValueError(f"{label}: reads={reads!r} is for metrics whose update takes one input; "
                             f"{update_signature(m)} takes two (outputs, targets). Leave reads out, or give "
                             f"transform=lambda outputs, targets: (preds, target) to choose what it gets")
        return lambda preds, targets: (preds, targets)
    if reads == "targets":
        return lambda preds, targets: (targets,)
    return lambda preds, targets: (preds,)


def _count(arity: Optional[Tuple[int, int]]) -> str:
    if arity is None:
        return "any number of arguments"
    required, most = arity
    if required == most:
        return f"{required} argument{'s' * (required != 1)}"
    return f"{required} to {most} arguments"
