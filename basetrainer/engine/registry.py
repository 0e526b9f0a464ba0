"""The run's stateful objects, in one registry: what a resumable checkpoint holds.

Each :class:`Part` is one stateful object of the run under a stable name, owning some keys of
the checkpoint (``model`` owns ``"model"``, the position ``"epoch"``, ``"phase"``, ...). The
:class:`Registry` of a run is built by its checkpointer
(:meth:`basetrainer.engine.checkpointer.Checkpointer.registry`); a save is one pass over it
(:meth:`Registry.prepare` on every rank, then :meth:`Registry.state_dict`), a resume one pass
(:meth:`Registry.load_state_dict`). The checkpoint is a flat dict of weights-only types, as
written since format 1, so older checkpoints keep loading.

Callbacks are one part (``"callbacks"``): each callback's state under its
:attr:`~basetrainer.callbacks.callbacks.Callback.state_key` (``#2``, ``#3`` appended when two
share one), through the methods :class:`~basetrainer.callbacks.callbacks.Callback` declares.
"""
import logging
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from basetrainer.runtime import checkpoint, comm, sharding
from basetrainer.utils import torch_tools

logger = logging.getLogger(__name__)


class Part:
    """One stateful object of the run: the checkpoint keys it owns and how it saves and restores
    them. The defaults save and restore nothing."""

    keys: Tuple[str, ...] = ()

    def prepare(self) -> None:
        """Every rank, before a save reads :meth:`state_dict` (collectives go here)."""

    def state_dict(self) -> Dict[str, Any]:
        """Its keys of the checkpoint."""
        return {}

    def load_state_dict(self, state: Dict[str, Any], source: str) -> None:
        """Restore from ``state`` (the whole checkpoint; a part reads its own keys).
        ``source`` names the file in messages."""


class Value(Part):
    """One key, read by ``get`` and (if ``put`` is given) restored by it when the checkpoint
    holds a value for it."""

    def __init__(self, key: str, get: Callable[[], Any], put: Optional[Callable[[Any], None]] = None) -> None:
        self.keys, self.get, self.put = (key,), get, put

    def state_dict(self) -> Dict[str, Any]:
        return {self.keys[0]: self.get()}

    def load_state_dict(self, state: Dict[str, Any], source: str) -> None:
        if self.put is not None and state.get(self.keys[0]):
            self.put(state[self.keys[0]])


class Fields(Part):
    """Several keys, read together by ``get`` (a dict of them) and restored by ``put(state,
    source)`` from the whole checkpoint."""

    def __init__(self, keys: Tuple[str, ...], get: Callable[[], Dict[str, Any]],
                 put: Callable[[Dict[str, Any], str], None]) -> None:
        self.keys, self.get, self.put = tuple(keys), get, put

    def state_dict(self) -> Dict[str, Any]:
        return self.get()

    def load_state_dict(self, state: Dict[str, Any], source: str) -> None:
        self.put(state, source)


class Weights(Part):
    """The model's and the optimizer's state (``"model"``, ``"optimizer"``): ``state_dict()``s
    of the unwrapped model; under fsdp by parameter name, sharded (DTensors, see
    :mod:`basetrainer.runtime.sharded`). A one-file checkpoint loads into a sharded model too."""

    keys = ("model", "optimizer")

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def state_dict(self) -> Dict[str, Any]:
        model, optimizer = self.engine.unwrapped_model, self.engine.optimizer
        if sharding.is_fsdp(model):
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

            return {"model": get_model_state_dict(model),
                    "optimizer": get_optimizer_state_dict(model, optimizer) if optimizer is not None else {}}
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict() if optimizer is not None else {}}

    def load_state_dict(self, state: Dict[str, Any], source: str) -> None:
        engine = self.engine
        if state.get("shards") or sharding.is_fsdp(engine.unwrapped_model):
            sharding.load_state(engine.unwrapped_model, engine.optimizer, state, full=not state.get("shards"))
            return
        torch_tools.load_weights(engine.model, state["model"], strict=True, source=source)
        if engine.optimizer is not None and state.get("optimizer"):
            engine.optimizer.load_state_dict(state["optimizer"])


class RandomState(Part):
    """Every rank's random generators (gathered on every rank in :meth:`prepare`); a resume
    gives each rank its own back (``restore``) when the run reaches the saved point."""

    keys = ("rng",)

    def __init__(self, capture: Callable[[], dict], restore: Callable[[dict], None]) -> None:
        self.capture, self.restore = capture, restore
        self.gathered: Optional[List[dict]] = None

    def prepare(self) -> None:
        self.gathered = comm.all_gather_object(self.capture())

    def state_dict(self) -> Dict[str, Any]:
        return {"rng": self.gathered if self.gathered is not None else [self.capture()]}

    def load_state_dict(self, state: Dict[str, Any], source: str) -> None:
        rngs = state.get("rng") or []
        rngs = [rngs] if isinstance(rngs, dict) else rngs   # a single process's (older files)
        if rngs:
            self.restore(rngs[comm.get_rank()] if len(rngs) == comm.get_world_size() else rngs[0])


def holds_state(state: Any) -> bool:
    """Whether a callback's saved state holds anything: None and empty dicts/lists do not. Not
    ``bool(state)``: a callback may return a tensor, whose truth is ambiguous."""
    if state is None:
        return False
    if isinstance(state, (dict, list, tuple, str)):
        return len(state) > 0
    return True


_LEGACY_KEY = re.compile(r"^(\d+):(.+)$")   # 2.0 keyed callback states by list position
_NUMBERED = re.compile(r"#\d+$")            # the second, third, ... callback of one state_key


class CallbackStates(Part):
    """Each callback's state under its stable key (see the module's docstring). On load, saved
    states nobody takes and callbacks with state but nothing saved are named in a warning."""

    keys = ("callbacks",)

    def __init__(self, callbacks: Sequence[Any]) -> None:
        self.callbacks = [cb for cb in callbacks if cb is not None]

    def keyed(self) -> List[Tuple[str, Any]]:
        """``(key, callback)`` for every callback, in list order."""
        out: List[Tuple[str, Any]] = []
        seen: Dict[str, int] = {}
        for cb in self.callbacks:
            try:
                key = str(cb.state_key)
            except Exception as e:
                if hasattr(e, "add_note"):
                    e.add_note(f"raised reading callback {type(cb).__name__}.state_key (its state's name in the checkpoint)")
                raise
            seen[key] = seen.get(key, 0) + 1
            out.append((key if seen[key] == 1 else f"{key}#{seen[key]}", cb))
        taken: Dict[str, Any] = {}
        for key, cb in out:   # a state_key of "A#2" beside two callbacks keyed "A": one state would be lost
            if key in taken:
                raise ValueError(f"callbacks {type(taken[key]).__name__} and {type(cb).__name__} both keep their state "
                                 f"under {key!r} in the checkpoint (two callbacks keyed {key.split('#')[0]!r} take "
                                 f"'#2', '#3', ... after it): give one of them another state_key")
            taken[key] = cb
        return out

    def prepare(self) -> None:
        for cb in self.callbacks:
            cb.prepare_state()

    def state_dict(self) -> Dict[str, Any]:
        """Raises:
            TypeError: a state holds what a resume could not load (checked at every save, not
                found when the run is resumed and none of its checkpoints loads)."""
        states = {}
        for key, cb in self.keyed():
            states[key] = cb.state_dict()
            found = checkpoint.unloadable(states[key])
            if found:
                raise TypeError(f"callback state {key!r}: {found}, which a resume cannot load (checkpoints load "
                                f"with weights_only=True: tensors, numbers, strings, lists, tuples, sets, dicts); "
                                f"return tensors or plain values from {type(cb).__name__}.state_dict() "
                                f"(torch.as_tensor(a), a.tolist(), float(x), list(d))")
        return {"callbacks": states}

    def load_state_dict(self, state: Dict[str, Any], source: str) -> None:
        saved = dict(state.get("callbacks") or {})
        if saved and all(_LEGACY_KEY.match(k) for k in saved):
            pairs = [(f"{i}:{type(cb).__name__}", cb) for i, cb in enumerate(self.callbacks)]
        else:
            pairs = self.keyed()
        _warn_numbered(saved, pairs, source)
        fresh = []
        for key, cb in pairs:
            if key in saved:
                try:
                    cb.load_state_dict(saved.pop(key))
                except Exception as e:
                    if hasattr(e, "add_note"):
                        e.add_note(f"raised in callback {type(cb).__name__}.load_state_dict, restoring its state "
                                   f"{key!r} from {source}")
                    raise
            elif holds_state(cb.state_dict()):
                fresh.append(key)
        # a removed callback that had no state lost nothing
        saved = {key: value for key, value in saved.items() if holds_state(value)}
        if saved:
            logger.warning("%s: saved state of %s matches no callback (removed, or its state_key changed?); "
                           "ignored", source, ", ".join(repr(k) for k in saved))
        if fresh:
            logger.warning("%s: no saved state for callback(s) %s (added since?); they start fresh",
                           source, ", ".join(repr(k) for k in fresh))


def _warn_numbered(saved: Dict[str, Any], pairs: List[Tuple[str, Any]], source: str) -> None:
    """Name the callbacks whose states are keyed by their order among callbacks of one key
    (``A``, ``A#2``, ...) when the checkpoint holds another number of them: each takes the state
    of its place, which may be another callback's (the first of two removed: the second takes its)."""
    def counts(keys: Any) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for key in keys:
            base = _NUMBERED.sub("", key)   # "A#2" -> "A"; a key the user chose ("loss#test") stays
            out[base] = out.get(base, 0) + 1
        return out

    before, now = counts(saved), counts(key for key, _ in pairs)
    for base in sorted(b for b in set(before) & set(now) if before[b] != now[b] and max(before[b], now[b]) > 1):
        logger.warning("%s: %d callbacks kept state under %r (numbered by their order: %r, '%s#2', ...) and %d do "
                       "now: each takes the state saved at its place, which may be another one's; give each a "
                       "state_key of its own", source, before[base], base, base, base, now[base])


class Registry:
    """The run's stateful objects by name (see the module's docstring).

    Args:
        parts: ``{name: part}``, saved and restored in this order.

    Raises:
        ValueError: two parts own the same checkpoint key.
    """

    def __init__(self, parts: Dict[str, Part]) -> None:
        owner: Dict[str, str] = {}
        for name, part in parts.items():
            for key in part.keys:
                if key in owner:
                    raise ValueError(f"checkpoint key {key!r} is owned by both {owner[key]!r} and {name!r}: "
                                     f"give one of them another key")
                owner[key] = name
        self.parts = dict(parts)

    def prepare(self) -> None:
        """Every rank, before :meth:`state_dict` (in the same order everywhere)."""
        for part in self.parts.values():
            part.prepare()

    def state_dict(self) -> Dict[str, Any]:
        """The checkpoint: every part's keys."""
        state: Dict[str, Any] = {}
        for part in self.parts.values():
            state.update(part.state_dict())
        return state

    def load_state_dict(self, state: Dict[str, Any], source: str = "checkpoint") -> None:
        """Restore every part from the checkpoint ``state``."""
        for part in self.parts.values():
            part.load_state_dict(state, source)
