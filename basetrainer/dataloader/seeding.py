"""Random draws per sample: a train item is loaded with the random generators seeded from
(seed, epoch, index), so augmentation draws the same for a sample whichever worker, batch or
resumed run loads it.

torch's generator is seeded for every item. numpy's and python's are seeded once they are seen
in use: where each one stands (its position and first state word, read through ctypes without
copying its state) is compared around every item; an item that moved a generator not yet seeded
is loaded again with that generator seeded too, and from then on it is seeded for every item. So
every item returned was drawn with each generator it used seeded from its key, while a pipeline
that draws from torch only (torchvision's transforms, mostly) pays for torch's seeding only.
Where a generator cannot be watched it is seeded for every item.
"""
import ctypes
import random
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

_MT_WORDS = 624   # the Mersenne Twister's state: 624 words, then the position


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed of (seed, epoch, index) (the hash of an int tuple is the same in every process)."""
    return hash((int(seed), int(epoch), int(index))) & 0x7FFFFFFFFFFFFFFF


class _Watch:
    """Where a Mersenne Twister stands: its position and first state word, read in place."""

    def __init__(self, position: ctypes.c_int, word: ctypes.c_uint32) -> None:
        self.position, self.word = position, word

    def mark(self) -> tuple:
        return self.position.value, self.word.value


def _python_watch() -> Optional[_Watch]:
    """python's ``random`` (CPython's generator object: the position, then the state words)."""
    try:
        base = id(random._inst)  # type: ignore[attr-defined]
        watch = _Watch(ctypes.c_int.from_address(base + 16), ctypes.c_uint32.from_address(base + 20))
        _, state, _ = random.getstate()
        return watch if watch.mark() == (state[-1], state[0]) else None
    except Exception:  # another interpreter: seed it for every item
        return None


def _numpy_watch() -> Optional[_Watch]:
    """numpy's legacy global generator (``np.random.seed``/``np.random.rand``...)."""
    try:
        address = np.random.mtrand._rand._bit_generator.ctypes.state_address  # type: ignore[attr-defined]
        watch = _Watch(ctypes.c_int.from_address(address + 4 * _MT_WORDS), ctypes.c_uint32.from_address(address))
        _, keys, pos = np.random.get_state()[:3]
        return watch if watch.mark() == (int(pos), int(keys[0])) else None
    except Exception:
        return None


class _Generators:
    """This process's global generators, and which of them items were seen to use."""

    def __init__(self) -> None:
        self.watches = {"numpy": _numpy_watch(), "python": _python_watch()}
        self.seeded = {name: watch is None for name, watch in self.watches.items()}
        self._unseeded = self._still_unseeded()

    def _still_unseeded(self) -> tuple:
        return tuple((name, watch) for name, watch in self.watches.items() if not self.seeded[name])

    def seed(self, s: int) -> None:
        torch.default_generator.manual_seed(s)
        if self.seeded["numpy"]:
            np.random.seed(s & 0xFFFFFFFF)
        if self.seeded["python"]:
            random.seed(s)

    def load(self, dataset: Any, index: int, s: int) -> Any:
        self.seed(s)
        unseeded = self._unseeded
        if not unseeded:
            return dataset[index]
        marks = [watch.mark() for _, watch in unseeded]
        item = dataset[index]
        moved = [name for (name, watch), mark in zip(unseeded, marks) if watch.mark() != mark]
        if moved:   # it draws from one more generator: from now on seeded, and this item again
            for name in moved:
                self.seeded[name] = True
            self._unseeded = self._still_unseeded()
            self.seed(s)
            item = dataset[index]
        return item


_GENERATORS: Optional[_Generators] = None


def _generators() -> _Generators:
    global _GENERATORS
    if _GENERATORS is None:
        _GENERATORS = _Generators()
    return _GENERATORS


class SeededDataset(Dataset):
    """``dataset`` whose items are loaded with the random generators seeded from (seed, epoch,
    index): give it ``(index, epoch)`` keys (a plain index is loaded as is). In the main process
    the generators' states are put back after each batch, so the training's own draws (dropout,
    ...) are not disturbed. Other attributes are the wrapped data set's.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "seed") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def _load(self, key: Any) -> Any:
        if type(key) is not tuple:
            return self.dataset[key]
        index, epoch = key
        return _generators().load(self.dataset, index, sample_seed(self.seed, epoch, index))

    def __getitem__(self, key: Any) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: List[Any]) -> List[Any]:
        if torch.utils.data.get_worker_info() is not None:   # a worker: its generators are its own
            return [self._load(k) for k in keys]
        saved: Dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                                 "python": random.getstate()}
        try:
            return [self._load(k) for k in keys]
        finally:
            torch.set_rng_state(saved["torch"])
            np.random.set_state(saved["numpy"])
            random.setstate(saved["python"])
