"""Counting what one training step (or one batch of a loader) does: torch ops dispatched, host
syncs, Python calls made inside basetrainer, bytes of tensors allocated. Counts, not times, so
that the budgets of tests/test_budget.py hold on a busy machine.

- *ops*: every aten op that reaches the dispatcher's Python key (a ``TorchDispatchMode``):
  forward, backward (the autograd engine runs CPU work on the calling thread, with the mode) and
  optimizer ops, by name.
- *syncs*: reads of a tensor's value by the host: ``aten::_local_scalar_dense`` (``.item()``,
  ``float(t)``, ``bool(t)``...), ops whose output size depends on the values (``nonzero``,
  ``masked_select``, ``unique``...), ``aten::equal``, and calls of ``Tensor.tolist``,
  ``.numpy``, ``.cpu`` and ``__array__`` (no-ops on a CPU tensor, each a device-to-host copy
  on a GPU).
- *calls*: Python function calls whose code is in the basetrainer package (``sys.setprofile``
  ``call`` events, generator resumptions included), by ``module:function``.
- *bytes*: the storage bytes of the tensors the ops made (outputs that are no view of, and not
  written into, an input): what the step allocated for tensors, kernels' scratch space aside.
"""
import collections
import contextlib
import os
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import basetrainer

PACKAGE = os.path.dirname(os.path.abspath(basetrainer.__file__)) + os.sep
SYNC_OPS = {"_local_scalar_dense", "item", "equal", "is_nonzero", "nonzero", "masked_select", "unique",
            "_unique", "_unique2", "unique_consecutive", "unique_dim", "allclose", "repeat_interleave"}
SYNC_METHODS = ("tolist", "numpy", "cpu", "__array__")


class Counts:
    """What one window (a step, a batch) did."""

    def __init__(self) -> None:
        self.ops: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.bytes = 0

    def summary(self) -> Dict[str, int]:
        return {"ops": sum(self.ops.values()), "syncs": sum(self.syncs.values()),
                "calls": sum(self.calls.values()), "bytes": self.bytes}

    def __repr__(self) -> str:
        return f"Counts({self.summary()})"


class _Ops(TorchDispatchMode):
    def __init__(self, counter: "Counter") -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        counts = self.counter.current
        out = func(*args, **(kwargs or {}))
        if counts is not None:
            name = func.overloadpacket.__name__
            counts.ops[name] += 1
            if name in SYNC_OPS:
                counts.syncs[f"aten::{name}"] += 1
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in inputs:
                        inputs.add(storage.data_ptr())
                        counts.bytes += storage.nbytes()
        return out


class Counter:
    """Counts the windows opened with :meth:`start` and closed with :meth:`stop` while it is
    entered (``with Counter() as c``). ``windows`` holds one :class:`Counts` per window."""

    def __init__(self) -> None:
        self.current: Optional[Counts] = None
        self.windows: List[Counts] = []
        self._mode = _Ops(self)
        self._saved: Dict[str, Any] = {}

    # -- the Python calls
    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and self.current is not None:
            code = frame.f_code
            if code.co_filename.startswith(PACKAGE):
                module = code.co_filename[len(PACKAGE):-3].replace(os.sep, ".")
                self.current.calls[f"{module}:{code.co_name}"] += 1

    def _wrap(self, name: str) -> Callable[..., Any]:
        original = getattr(torch.Tensor, name)

        def method(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if self.current is not None:
                self.current.syncs[f"Tensor.{name}"] += 1
            return original(tensor, *args, **kwargs)

        return method

    def __enter__(self) -> "Counter":
        for name in SYNC_METHODS:
            self._saved[name] = torch.Tensor.__dict__.get(name, getattr(torch.Tensor, name))
            setattr(torch.Tensor, name, self._wrap(name))
        self._mode.__enter__()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(None)
        if self.current is not None:
            self.stop()
        self._mode.__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)

    def start(self) -> None:
        """Open a window."""
        self.current = Counts()

    def stop(self) -> Counts:
        """Close the window; its counts."""
        counts, self.current = self.current, None
        self.windows.append(counts)
        return counts


def counted_loader(loader: Any, counter: Counter) -> Any:
    """Make ``loader`` (a DataLoader) open a window when it hands out a batch and close it when
    the next one is asked for: each window is one step of the loop that iterates it."""
    base = type(loader)

    class Counted(base):  # type: ignore[valid-type, misc]
        def __iter__(self) -> Iterator[Any]:
            it = base.__iter__(self)
            while True:
                if counter.current is not None:
                    counter.stop()
                try:
                    batch = next(it)
                except StopIteration:
                    return
                counter.start()
                yield batch

    loader.__class__ = Counted
    return loader


@contextlib.contextmanager
def counting() -> Iterator[Counter]:
    """``with counting() as c:`` a :class:`Counter` entered."""
    with Counter() as c:
        yield c


def difference(b: collections.Counter, h: collections.Counter) -> Dict[str, int]:
    """What ``b`` counts more (or less: negative) than ``h``, by name."""
    return {k: b[k] - h[k] for k in sorted(set(b) | set(h)) if b[k] != h[k]}
