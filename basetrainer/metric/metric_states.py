"""The states of a torchmetrics ``Metric`` (or of each member of a ``MetricCollection``), reduced
over every DDP rank with basetrainer's own collectives.

torchmetrics synchronises its states itself (``sync_on_compute``, ``dist_sync_on_step``,
``Metric.sync()``/``unsync()``), but its sync is a collective inside ``compute()``, and ranks
hold different numbers of batches (exact sharding) while the running train figure is read on
one rank's state only; so :class:`~basetrainer.metric.metric_recorder.MetricRecorder` turns it
off and calls :func:`reduce_states` once per phase end, on every rank, instead. Called by hand,
``sync()`` is exact for sum and cat states when every rank saw a batch, but not for the shards
exact sharding makes (an idle rank; a list state of another length on each rank): the cases and
figures are in :mod:`basetrainer.callbacks.recorder`, where the summed states are reduced, in
the one place every recorder shares (:func:`~basetrainer.callbacks.recorder.sum_over_ranks`).

Each state is reduced by its ``dist_reduce_fx``:

- ``"sum"``: one ``all_reduce`` per dtype (integer counts stay exact);
- ``"cat"``, and list states with no reduction: the ranks' items, rank 0's first;
- ``"min"`` / ``"max"``: over every rank (a rank that saw no batch holds the default, which is
  neutral); ``"mean"``: over the ranks that saw a batch (as torchmetrics does, a mean of ranks,
  not of samples);
- a tensor state with no reduction, or a custom callable: refused when the recorder is built
  (:func:`check_reducible`), since no rank-count-free answer exists.

A rank that saw no batch takes part all the same (its states are the defaults). torchmetrics is
imported only when one of these functions runs.

Only torchmetrics' public API is used (``metric_state``, ``update_count``, ``reset()``,
``load_state_dict()``, the ``sync_on_compute`` / ``dist_sync_on_step`` /
``distributed_available_fn`` settings), except in :func:`reductions` and
:func:`_restore_update_count`, which say why.
"""
from typing import Any, Dict, List, Tuple

import torch

from basetrainer.callbacks.recorder import sum_over_ranks
from basetrainer.runtime import comm

# what one member's reduced state looks like: {"count": updates over all ranks, "states": {...}}
Reduced = Dict[str, Dict[str, Any]]


def members(metric: Any) -> List[Tuple[str, Any]]:
    """``[(name, Metric)]``: the members of a collection (base names, compute-group states shared
    and current), or ``[("", metric)]``."""
    from torchmetrics import MetricCollection

    if isinstance(metric, MetricCollection):
        return list(metric.items(keep_base=True, copy_state=False))
    return [("", metric)]


def reduction_kinds(metric: Any) -> Dict[str, str]:
    """``{state name: "sum" | "mean" | "min" | "max" | "cat" | "list"}`` of one Metric.

    Raises:
        ValueError: a state reduced by a custom function, or a tensor state with no reduction.
    """
    from torchmetrics.utilities import data

    table = {data.dim_zero_sum: "sum", data.dim_zero_mean: "mean", data.dim_zero_min: "min",
             data.dim_zero_max: "max", data.dim_zero_cat: "cat"}
    kinds = {}
    state = metric.metric_state
    for name, fx in reductions(metric).items():
        is_list = isinstance(state[name], list)
        kind = table.get(fx) if fx is not None else ("list" if is_list else None)
        if kind is None:
            how = "no dist_reduce_fx" if fx is None else f"dist_reduce_fx={getattr(fx, '__name__', fx)!r}"
            raise ValueError(f"{type(metric).__name__}: state {name!r} has {how}; MetricRecorder reduces states "
                             f"over ranks by 'sum', 'cat', 'min', 'max' or 'mean' (or list states with none): "
                             f"add the state with one of those, or record this figure with a FunctionRecorder")
        kinds[name] = "list" if kind == "cat" and is_list else kind
    return kinds


def check_reducible(metric: Any) -> None:
    """Raise early (when a recorder is built) if a state cannot be reduced over ranks, or the
    metric's figure is not held in states of its own.

    Raises:
        ValueError: a state with a reduction MetricRecorder cannot do; a wrapper that keeps its
            states in the metrics it wraps (``MinMaxMetric``, ``BootStrapper``, ...: a recorder
            would publish nothing); a running window (``Running``, ``RunningMean``: the last
            updates, not the epoch).
    """
    from torchmetrics import Metric
    from torchmetrics.wrappers import Running

    for _, m in members(metric):
        inner = [type(c).__name__ for c in m.modules() if isinstance(c, Metric) and c is not m]
        if isinstance(m, Running):
            raise ValueError(f"{type(m).__name__} is a window of the last {m.window} updates, not an epoch's figure; "
                             f"record the metric it wraps ({', '.join(inner[:1])}) for the whole epoch")
        if not m.metric_state and inner:
            wrapped = ", ".join(sorted(set(inner)))
            raise ValueError(f"{type(m).__name__} keeps its states in the metrics it wraps ({wrapped}), "
                             f"which MetricRecorder does not reduce over ranks: record the wrapped metric itself, or "
                             f"compute the figure with a FunctionRecorder")
        reduction_kinds(m)


def local_states(metric: Any) -> Reduced:
    """This rank's states, copied to the CPU (what a one-process checkpoint saves)."""
    out: Reduced = {}
    for name, m in members(metric):
        out[name] = {"count": m.update_count, "states": {s: _to_cpu(v) for s, v in m.metric_state.items()}}
    return out


def reduce_states(metric: Any) -> Reduced:
    """Every member's states reduced over all ranks (new tensors; the metric is untouched).

    A collective: every rank must call it, also one that saw no batch. Sum states come back on
    the metric's device, the others on the CPU.
    """
    if comm.get_world_size() == 1:
        return local_states(metric)
    parts = members(metric)
    kinds = {name: reduction_kinds(m) for name, m in parts}
    sums: Dict[str, torch.Tensor] = {}
    payload = {}
    for name, m in parts:
        gather, state, fxs = {}, m.metric_state, reductions(m)
        for s, kind in kinds[name].items():
            value = state[s]
            if kind == "sum":
                if m.update_count:   # a rank that saw no batch adds nothing (its default may be shaped otherwise)
                    sums[_sum_key(name, m, s)] = value
            elif kind == "list" and fxs[s] is not None and len(value) > 1:
                gather[s] = [torch.cat([v.reshape(-1, *v.shape[1:]) if v.dim() else v.reshape(1)
                                        for v in value]).cpu()]   # "cat": one tensor, as torchmetrics does
            else:
                gather[s] = _to_cpu(value)
        payload[name] = {"count": m.update_count, "gather": gather}
    summed, ranks = sum_over_ranks(sums, payload)   # every rank's counts and non-sum states beside

    out: Reduced = {}
    for name, m in parts:
        counts = [r[name]["count"] for r in ranks]
        seen = [r for r, c in zip(ranks, counts) if c > 0] or ranks
        states: Dict[str, Any] = {}
        for s, kind in kinds[name].items():
            if kind == "sum":   # no rank saw a batch: the default, as a fresh metric holds it
                states[s] = summed.get(_sum_key(name, m, s), m.metric_state[s].detach().clone())
                continue
            values = [r[name]["gather"][s] for r in (ranks if kind in ("list", "min", "max") else seen)]
            if kind == "list":
                states[s] = [t for v in values for t in v]
            elif kind == "cat":
                states[s] = torch.cat([v.reshape(-1, *v.shape[1:]) if v.dim() else v.reshape(1) for v in values])
            elif kind == "min":
                states[s] = torch.stack(values).amin(dim=0)
            elif kind == "max":
                states[s] = torch.stack(values).amax(dim=0)
            else:  # mean of the ranks that saw a batch
                states[s] = torch.stack(values).float().mean(dim=0).to(values[0].dtype)
        out[name] = {"count": sum(counts), "states": states}
    return out


def _sum_key(name: str, metric: Any, state: str) -> str:
    return f"{name or type(metric).__name__}.{state}"


def load_states(metric: Any, reduced: Reduced) -> None:
    """Set every member's states (and update count) from ``reduced``, on the metric's device."""
    for name, m in members(metric):
        part = reduced.get(name)
        if part is None:
            raise KeyError(f"saved metric states have no member {name!r} (members saved: {sorted(reduced)}); "
                           f"the recorder's metric changed since the checkpoint")
        device = m.device
        states = {s: [t.to(device) for t in v] if isinstance(v, list) else v.to(device)
                  for s, v in part["states"].items()}
        m.reset()   # also drops a cached compute() value
        m.load_state_dict(states, strict=False)
        _restore_update_count(m, int(part["count"]))


def local_only(metric: Any) -> None:
    """Turn off torchmetrics' own syncs (a collective inside ``compute()``/``forward()``), through
    its public settings: ``sync_on_compute``, ``dist_sync_on_step``, and
    ``distributed_available_fn`` (the metric copied ``sync_on_compute`` into a private flag when
    it was built; with this function saying "not distributed", ``sync()`` returns at once)."""
    for _, m in members(metric):
        m.sync_on_compute = m.dist_sync_on_step = False
        m.distributed_available_fn = _not_distributed


def _not_distributed() -> bool:
    return False


def reductions(metric: Any) -> Dict[str, Any]:
    """``{state name: dist_reduce_fx}`` of one Metric, as given to ``add_state``.

    torchmetrics 1.9 has no public accessor for a state's reduction (``metric_state`` gives the
    values only, ``state_dict()`` neither): it is read here, and only here, from ``_reductions``.
    """
    return dict(metric._reductions)


def _restore_update_count(metric: Any, count: int) -> None:
    """Give a metric whose states were loaded the update count they came with.

    torchmetrics 1.9 has no public way to set it (``update_count`` is a read-only property,
    ``reset()`` zeroes it, ``load_state_dict()`` does not carry it); without it a restored metric
    would count as having seen no batch (its sum states left out of the reduction over ranks, a
    warning at ``compute()``). This is the one write of a torchmetrics private field.
    """
    metric._update_count = count


def compute_reduced(metric: Any, reduced: Reduced) -> Any:
    """``metric.compute()`` on a copy that holds ``reduced`` (the live states stay as they are)."""
    import copy

    twin = copy.deepcopy(metric)
    load_states(twin, reduced)
    local_only(twin)   # the states are reduced already: no second (collective) sync
    return twin.compute()


def _to_cpu(value: Any) -> Any:
    if isinstance(value, list):
        return [t.detach().cpu().clone() for t in value]
    return value.detach().cpu().clone()
