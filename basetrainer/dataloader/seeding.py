"""Random draws per sample: a train item is loaded with the global random generators it draws
from seeded from (seed, epoch, index), so augmentation draws the same for a sample whichever
worker, batch or resumed run loads it.

The generators are torch's CPU generator, numpy's legacy global one (``np.random.rand``...) and
python's ``random``. Each is seeded for an item only once items are seen drawing from it, so a
data set pays for the generators it uses: where each stands (8 bytes of its state that every
draw changes, read in place through ctypes) is compared around every item; an item that moved a
generator not yet seeded is loaded again with that generator seeded too, and from then on it is
seeded for every item. An in-memory data set that draws nothing pays for the comparisons (well
under a microsecond an item), torchvision's transforms (torch only) for seeding torch (about a
microsecond). torch's *initial seed* is the item's seed while any item loads (8 bytes written),
so ``torch.initial_seed()`` in ``__getitem__`` is the sample's seed, for a generator the data
set makes from it. A generator that cannot be watched here (another build's layout) is seeded
for every item, as exactly.

In the main process (``num_workers=0``) the generators' states are copied before each batch and
put back after it, so the training's own draws (dropout, ...) are not disturbed.

Not seeded: CUDA generators (a data set that draws on the GPU is rare; seed it from
``torch.initial_seed()`` yourself) and generators a data set keeps of its own.
"""
import ctypes
import operator
import random
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

_MASK = 0x7FFFFFFFFFFFFFFF
_MT_BYTES = 624 * 4           # a Mersenne Twister's state words
_VALUE = operator.attrgetter("value")
_Region = Tuple[int, int]     # (address, bytes)
# torch's CPU generator from its seed_: seed_ u64, left_ i32, seeded_ (+3), next_ u32, state_
# u32[624], optional<float> (8 bytes), 4 bytes to align, optional<double> (16 bytes)
_TORCH_BYTES = 20 + _MT_BYTES + 8 + 4 + 16


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed of (seed, epoch, index) (the hash of an int tuple is the same in every process)."""
    return hash((int(seed), int(epoch), int(index))) & _MASK


class _Generator:
    """One global generator.

    Attributes:
        name: ``torch``, ``numpy`` or ``python``.
        seed: seeds it from a sample's seed.
        mark: 8 bytes of its state that every draw changes (read in place), or None where it
            cannot be watched (then it is seeded for every item).
        regions: ``(address, bytes)`` spans that hold its whole state, copied in place to save
            and put back (empty: saved through its own get/set functions).
    """

    def __init__(self, name: str, seed: Callable[[int], None], mark: Optional[ctypes.c_uint64],
                 regions: Tuple[_Region, ...], get: Callable[[], Any], put: Callable[[Any], None],
                 extra: Optional[Tuple[Callable[[], Any], Callable[[Any], None]]] = None) -> None:
        self.name, self.seed, self.mark, self.regions = name, seed, mark, regions
        self._get, self._put, self._extra = get, put, extra
        self._views = [memoryview((ctypes.c_uint8 * n).from_address(a)).cast("B") for a, n in regions]

    def save(self) -> Any:
        if not self._views:
            return self._get()
        return [bytes(v) for v in self._views], (self._extra[0]() if self._extra else None)

    def restore(self, state: Any) -> None:
        if not self._views:
            self._put(state)
            return
        copied, extra = state
        for view, data in zip(self._views, copied):
            view[:] = data
        if self._extra:
            self._extra[1](extra)


def _round_trips(regions: Tuple[_Region, ...], get: Callable[[], Any], draw: Callable[[], Any]) -> bool:
    """Whether copying ``regions`` saves and puts back the whole state ``get`` reports."""
    before, copied = get(), [ctypes.string_at(a, n) for a, n in regions]
    draw()
    for (address, size), data in zip(regions, copied):
        ctypes.memmove(address, data, size)
    after = get()
    return bool(torch.equal(before, after)) if isinstance(before, torch.Tensor) else repr(before) == repr(after)


def _inside_allocation(start: int, size: int) -> bool:
    """Whether ``size`` bytes from ``start`` (a block from malloc) lie inside that block."""
    try:
        usable = ctypes.CDLL(None).malloc_usable_size
    except (AttributeError, OSError):
        return False
    usable.restype, usable.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
    return size <= usable(start)


def _torch_layout(g: torch.Generator) -> Optional[int]:
    """The address of a CPU generator's Mersenne Twister data (seed_ u64, left_ i32, seeded_,
    next_ u32, state_ u32[624], then the cached normal samples), found from its ``get_state()``."""
    impl = ctypes.c_void_p.from_address(id(g) + 16).value  # THPGenerator: the head, then its impl
    if not impl:
        return None
    state = g.get_state().numpy()                   # legacy pod: seed u64, left i32, seeded i32, next u64, state u64[624]
    words = np.frombuffer(state.tobytes(), dtype=np.uint64, count=624, offset=24).astype(np.uint32).tobytes()
    at = ctypes.string_at(impl, 1024).find(words[:16])
    return impl + at - 20 if at >= 20 else None


def _torch_generator() -> _Generator:
    g = torch.default_generator
    fallback = _Generator("torch", g.manual_seed, None, (), g.get_state, g.set_state)
    try:
        probe = torch.Generator()                   # the layout, checked on a generator of its own
        probe.manual_seed(12345)
        torch.randn(3, generator=probe)
        base = _torch_layout(probe)
        if base is None:
            return fallback
        offset = base - ctypes.c_void_p.from_address(id(probe) + 16).value
        seed_field = ctypes.c_uint64.from_address(base)
        mark = ctypes.c_uint64.from_address(base + 16)       # next_, state_[0]

        def expected(gen: torch.Generator) -> Tuple[int, int]:
            raw = gen.get_state().numpy().tobytes()
            return (int(np.frombuffer(raw, np.uint64, 1, 0)[0]),
                    int(np.frombuffer(raw, np.uint64, 1, 16)[0]) | int(np.frombuffer(raw, np.uint64, 1, 24)[0]) << 32)

        region = ((base, _TORCH_BYTES),)
        if not _inside_allocation(base - offset, offset + _TORCH_BYTES):
            return fallback
        before = mark.value
        if (seed_field.value, mark.value) != expected(probe) or not _round_trips(
                region, probe.get_state, lambda: (torch.randn(1, generator=probe), torch.rand(5, generator=probe))):
            return fallback
        torch.rand(1, generator=probe)
        if mark.value == before or (seed_field.value, mark.value) != expected(probe):
            return fallback
        base = ctypes.c_void_p.from_address(id(g) + 16).value + offset
        generator = _Generator("torch", g.manual_seed, ctypes.c_uint64.from_address(base + 16),
                               ((base, region[0][1]),), g.get_state, g.set_state)
        if (ctypes.c_uint64.from_address(base).value, generator.mark.value) != expected(g):
            return fallback
        generator.initial_seed = ctypes.c_uint64.from_address(base)  # type: ignore[attr-defined]
        return generator
    except Exception:  # another build: seeded for every item, saved through get_state
        return fallback


def _numpy_gauss(rs: np.random.RandomState) -> Optional[int]:
    """The address of a RandomState's cached gaussian (``has_gauss`` i32, ``gauss`` f64), which
    follows a pointer to the RandomState's own bit generator struct."""
    base, size = id(rs), type(rs).__basicsize__
    for offset in range(16, size - 24, 8):
        pointer = ctypes.c_uint64.from_address(base + offset).value
        if base < pointer < base + size:
            return base + offset + 8
    return None


def _numpy_generator() -> _Generator:
    rs = np.random.mtrand._rand  # type: ignore[attr-defined]
    fallback = _Generator("numpy", lambda s: np.random.seed(s & 0xFFFFFFFF), None, (), np.random.get_state,
                          np.random.set_state)
    try:
        probe = np.random.RandomState(0)
        probe.standard_normal()                     # a gaussian cached
        gauss = _numpy_gauss(probe)
        if gauss is None or (ctypes.c_int.from_address(gauss).value, ctypes.c_double.from_address(gauss + 8).value) \
                != tuple(probe.get_state()[3:5]):
            return fallback
        offset = gauss - id(probe)
        address = probe._bit_generator.ctypes.state_address   # key u32[624], pos i32
        regions = ((address, _MT_BYTES + 4), (gauss, 16))
        if not _round_trips(regions, probe.get_state, lambda: probe.standard_normal(3)):
            return fallback
        address = rs._bit_generator.ctypes.state_address
        gauss = id(rs) + offset
        mark = ctypes.c_uint64.from_address(address + _MT_BYTES - 4)   # key[623], pos
        _, keys, pos, has_gauss, cached = rs.get_state()
        if (mark.value != int(keys[623]) | int(pos) << 32 or _numpy_gauss(rs) != gauss
                or (ctypes.c_int.from_address(gauss).value, ctypes.c_double.from_address(gauss + 8).value)
                != (has_gauss, cached)):
            return fallback
        return _Generator("numpy", fallback.seed, mark, ((address, _MT_BYTES + 4), (gauss, 16)),
                          np.random.get_state, np.random.set_state)
    except Exception:
        return fallback


def _python_generator() -> _Generator:
    inst = random._inst  # type: ignore[attr-defined]
    fallback = _Generator("python", random.seed, None, (), random.getstate, random.setstate)
    try:
        probe = random.Random(0)          # CPython's generator object: the position, then the words
        region = ((id(probe) + 16, 4 + _MT_BYTES),)
        if not _round_trips(region, probe.getstate, lambda: probe.random()):
            return fallback
        base = id(inst)
        mark = ctypes.c_uint64.from_address(base + 16)     # position, state[0]
        _, state, _ = random.getstate()
        if mark.value != state[-1] | state[0] << 32:
            return fallback

        def put_gauss(value: Any) -> None:
            inst.gauss_next = value

        return _Generator("python", random.seed, mark, ((base + 16, 4 + _MT_BYTES),), random.getstate,
                          random.setstate, (lambda: inst.gauss_next, put_gauss))
    except Exception:  # another interpreter: seeded for every item
        return fallback


class _Generators:
    """This process's global generators, and which of them items were seen to use."""

    def __init__(self) -> None:
        self.all = (_torch_generator(), _numpy_generator(), _python_generator())
        self.watches = {g.name: g.mark for g in self.all}   # None: cannot be watched, seeded every item
        self.seeded = {g.name: g.mark is None for g in self.all}
        self._update()

    def _update(self) -> None:
        self.seeders = tuple(g.seed for g in self.all if self.seeded[g.name])
        self.watched = tuple(g for g in self.all if not self.seeded[g.name])
        torch_generator = self.all[0]
        self.initial_seed = getattr(torch_generator, "initial_seed", None) if not self.seeded["torch"] else None

    def marks(self) -> Tuple[int, ...]:
        """Where each generator not yet seeded stands."""
        return tuple([g.mark.value for g in self.watched])

    def load(self, dataset: Any, keys: List[Any], seed: int) -> List[Any]:
        """``dataset[index]`` of each ``(index, epoch)`` key, drawn from generators seeded from
        (seed, epoch, index) (a plain index is loaded as is). A batch that moved a generator not
        yet seeded is loaded again with it seeded (and from then on it is seeded for every item)."""
        while True:
            before = self.marks()
            items = self._load(dataset, keys, seed)
            after = self.marks()
            if after == before:
                return items
            for generator, a, b in zip(self.watched, before, after):
                if a != b:
                    self.seeded[generator.name] = True
            self._update()

    def _load(self, dataset: Any, keys: List[Any], seed: int) -> List[Any]:
        seeders, initial_seed = self.seeders, self.initial_seed
        items = []
        for key in keys:
            if type(key) is not tuple:
                items.append(dataset[key])
                continue
            index, epoch = key
            s = hash((seed, epoch, index)) & _MASK      # sample_seed, inline: this runs for every item
            for seed_with in seeders:
                seed_with(s)
            if initial_seed is not None:                # torch.initial_seed() is the sample's seed
                initial_seed.value = s
            items.append(dataset[index])
        return items

    def save(self) -> List[Any]:
        return [g.save() for g in self.all]

    def restore(self, states: List[Any]) -> None:
        """Put back what :meth:`save` copied: torch's (its initial seed was written), and each
        generator seeded now (one not seeded was not moved)."""
        for g, state in zip(self.all, states):
            if g.name == "torch" or self.seeded[g.name]:
                g.restore(state)


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
        self.seed = int(seed)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "seed") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, key: Any) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: List[Any]) -> List[Any]:
        generators = _GENERATORS or _generators()
        if torch.utils.data.get_worker_info() is not None:   # a worker: its generators are its own
            return generators.load(self.dataset, keys, self.seed)
        saved = generators.save()
        try:
            return generators.load(self.dataset, keys, self.seed)
        finally:
            generators.restore(saved)
