"""Random draws per sample: a train item is loaded with the global random generators it draws
from seeded from (seed, epoch, index), so augmentation draws the same for a sample whichever
worker, batch or resumed run loads it.

The generators are torch's CPU generator, numpy's legacy global one (``np.random.rand``...) and
python's ``random``, reached through their public functions only. torch's is seeded for every
item (``torch.default_generator.manual_seed``, about a microsecond), which also makes
``torch.initial_seed()`` the sample's seed while the item loads, for a generator the data set
makes from it. numpy's and python's cost more to seed (about 3 and 5 microseconds an item), so
each is seeded for an item only once items are seen drawing from it: until then every batch is
loaded with it seeded with :data:`MARKER`, and a first draw after the batch other than the one
that seed gives shows that the batch drew from it; that batch is loaded again with the
generator seeded too, and from then on it is seeded for every item.

In the main process (``num_workers=0``) the three generators' states are saved before each
batch and put back after it (``get_state``/``set_state``, ``random.getstate``/``setstate``),
so the training's own draws (dropout, ...) are not disturbed.

Not seeded: CUDA generators (a data set that draws on the GPU is rare; seed it from
``torch.initial_seed()`` yourself) and generators a data set keeps of its own.
"""
import random
from typing import Any, Dict, List

import numpy as np
import torch
from torch.utils.data import Dataset

_MASK = 0x7FFFFFFFFFFFFFFF
MARKER = 0x5EED  # the seed of a generator not seen in use while a batch loads


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed of (seed, epoch, index) (the hash of an int tuple is the same in every process)."""
    return hash((int(seed), int(epoch), int(index))) & _MASK


class _Generators:
    """How one :class:`SeededDataset` drives this process's global generators, and which of
    them its items were seen drawing from.

    Attributes:
        seeded: per generator (``torch``, ``numpy``, ``python``), whether it is seeded for every
            item; torch's always is.
    """

    def __init__(self) -> None:
        self.seeded: Dict[str, bool] = {"torch": True, "numpy": False, "python": False}
        # the first draw of each after seeding it with MARKER, from generators of their own
        self.marker_draws = {"numpy": float(np.random.RandomState(MARKER).random_sample()),
                             "python": random.Random(MARKER).random()}

    def load(self, dataset: Any, keys: List[Any], seed: int, main: bool) -> List[Any]:
        """``dataset[index]`` of each ``(index, epoch)`` key, drawn from generators seeded from
        (seed, epoch, index) (a plain index is loaded as is). A batch that drew from a generator
        not yet seeded is loaded again with it seeded (and from then on it is seeded for every
        item). In the main process (``main``) every generator is left as it was found."""
        while True:
            if main:
                saved = (torch.default_generator.get_state(), np.random.get_state(), random.getstate())
            watch_numpy, watch_python = not self.seeded["numpy"], not self.seeded["python"]
            if watch_numpy:
                np.random.seed(MARKER)
            if watch_python:
                random.seed(MARKER)
            try:
                items = self._load(dataset, keys, seed)
                drew_numpy = watch_numpy and np.random.random_sample() != self.marker_draws["numpy"]
                drew_python = watch_python and random.random() != self.marker_draws["python"]
            finally:
                if main:
                    torch.default_generator.set_state(saved[0])
                    np.random.set_state(saved[1])
                    random.setstate(saved[2])
            if not (drew_numpy or drew_python):
                return items
            self.seeded["numpy"] = self.seeded["numpy"] or drew_numpy
            self.seeded["python"] = self.seeded["python"] or drew_python

    def _load(self, dataset: Any, keys: List[Any], seed: int) -> List[Any]:
        seed_torch = torch.default_generator.manual_seed
        seed_numpy, seed_python = self.seeded["numpy"], self.seeded["python"]
        items = []
        for key in keys:
            if type(key) is not tuple:
                items.append(dataset[key])
                continue
            index, epoch = key
            s = hash((seed, epoch, index)) & _MASK      # sample_seed, inline: this runs for every item
            seed_torch(s)
            if seed_numpy:
                np.random.seed(s & 0xFFFFFFFF)
            if seed_python:
                random.seed(s)
            items.append(dataset[index])
        return items


class SeededDataset(Dataset):
    """``dataset`` whose items are loaded with the random generators seeded from (seed, epoch,
    index): give it ``(index, epoch)`` keys (a plain index is loaded as is). In the main process
    the generators' states are put back after each batch, so the training's own draws (dropout,
    ...) are not disturbed. Other attributes are the wrapped data set's.

    Attributes:
        generators: which generators its items were seen drawing from, in this process (a
            worker process learns on its own copy).
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = int(seed)
        self.generators = _Generators()

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "seed", "generators") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, key: Any) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: List[Any]) -> List[Any]:
        # a worker's generators are its own; the main process's are the training's too
        return self.generators.load(self.dataset, keys, self.seed, torch.utils.data.get_worker_info() is None)
