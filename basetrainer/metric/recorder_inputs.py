"""What a recorder reads from a step: the model's outputs (:func:`pick_output`: a dict's
``output_key``, ``"logits"``, ``"out"`` or only entry; a tuple's first element) and the batch's
targets (a dict's ``target_key``), and what a metric's ``update`` is given of them: what the
user chose (``reads``, ``transform``), by default ``(outputs, targets)``, never guessed from the
update's parameters."""
import inspect
from typing import Any, Callable, Optional, Sequence, Tuple

from basetrainer.callbacks.callbacks import pick_output, targets_of   # pick_output: the one rule, re-exported


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


def is_aggregator(metric: Any) -> bool:
    """torchmetrics' aggregators (``MeanMetric``, ``MaxMetric``, ``MinMetric``, ``SumMetric``,
    ``CatMetric``: ``torchmetrics.aggregation.BaseAggregator``) aggregate one value per update."""
    from torchmetrics.aggregation import BaseAggregator

    return isinstance(metric, BaseAggregator)


def update_driver(members: Sequence[Tuple[str, Any]], label: str, reads: Optional[str],
                  transform: Optional[Callable[[Any, Any], Any]]) -> Callable[[Any, Any], Tuple[Any, ...]]:
    """``args(outputs, targets)``: the arguments a recorder passes to the update of a metric whose
    members are ``members`` (``[(name, Metric)]``), chosen by the user, not read from the update:

    - ``transform(outputs, targets)``: its return (a tuple is several arguments, anything else one);
    - ``reads="outputs"`` or ``"targets"``: that one input;
    - neither: ``(outputs, targets)``, or the outputs alone for torchmetrics' aggregators.

    Raises:
        ValueError: ``reads`` is not ``"outputs"``/``"targets"`` or is given with ``transform``;
            a collection mixes aggregators and other metrics without ``reads``.
        TypeError: an update that does not take the inputs chosen (named with the fix).
    """
    if reads is not None and reads not in READS:
        raise ValueError(f"{label}: reads={reads!r}; a one-input metric reads 'outputs' or 'targets' "
                         f"(or give transform=lambda outputs, targets: value)")
    if reads is not None and transform is not None:
        raise ValueError(f"{label}: reads={reads!r} and transform are given; the transform's return is what the "
                         f"update takes: give one of them, not both")
    if transform is not None:
        return lambda outputs, targets: _as_args(transform(outputs, targets))
    one = {name: is_aggregator(m) for name, m in members}
    if reads is None and len(set(one.values())) > 1:
        ones = ", ".join(repr(n) for n, k in one.items() if k)
        twos = ", ".join(repr(n) for n, k in one.items() if not k)
        raise ValueError(f"{label}: the MetricCollection's members {ones} take one input and {twos} two (outputs, "
                         f"targets); put the one-input metrics in their own MetricRecorder (with reads= 'outputs' "
                         f"or 'targets')")
    if reads is None and all(one.values()):
        reads = "outputs"
    given = f"({reads})" if reads else "(outputs, targets)"
    for _, m in members:
        _check_takes(m, 1 if reads else 2, label, given)
    if reads == "targets":
        return lambda outputs, targets: (targets,)
    if reads == "outputs":
        return lambda outputs, targets: (outputs,)
    return lambda outputs, targets: (outputs, targets)


def _as_args(value: Any) -> Tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


FIX = ("give reads='outputs' or reads='targets' (one input), or transform=lambda outputs, targets: (...) "
       "returning update's arguments, or record the figure with a FunctionRecorder")


def _check_takes(metric: Any, count: int, label: str, given: str) -> None:
    """Raise now, naming the fix, when ``metric.update`` cannot be called with ``count``
    positional arguments (the inputs chosen), rather than at the first step inside the metric."""
    try:
        signature = inspect.signature(metric.update)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*range(count))
    except TypeError as e:
        bare = signature.replace(parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
                                 return_annotation=signature.empty)
        raise TypeError(f"{label}: MetricRecorder calls {type(metric).__name__}.update{bare} with {given}, "
                        f"which it does not take ({e}): {FIX}") from None


def update_error(label: str, metric: Any, args: Tuple[Any, ...], transform: bool, error: TypeError) -> TypeError:
    """The error for an update that raised TypeError on the arguments it was given."""
    what = f"transform returned {len(args)} value{'s' * (len(args) != 1)}" if transform else \
        f"it got {len(args)} input{'s' * (len(args) != 1)}"
    return TypeError(f"{label}: {type(metric).__name__}.update raised TypeError ({error}); {what}: {FIX}")
