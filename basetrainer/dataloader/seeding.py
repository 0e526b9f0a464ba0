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
import functools
import operator
import random
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

_MASK = 0x7FFFFFFFFFFFFFFF
_MT_BYTES = 624 * 4           # a Mersenne Twister's state words
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
        readers: zero-argument C callables (``functools.partial``) reading, in place, values that
            change with every draw (its position, a state word, its cached gaussian); empty where
            it cannot be watched (then it is seeded for every item and saved through
            ``get``/``put``, its own functions).
        regions: ``(address, bytes)`` spans that hold its whole state, copied in place.
        extra: a ``(get, put)`` pair for state kept outside them (python's cached gaussian).
        initial_seed: torch's initial seed, written for every item.
    """

    def __init__(self, name: str, seed: Callable[[int], None], get: Callable[[], Any], put: Callable[[Any], None],
                 readers: Tuple[Callable[[], Any], ...] = (), regions: Tuple[_Region, ...] = (),
                 extra: Optional[Tuple[Callable[[], Any], Callable[[Any], None]]] = None,
                 initial_seed: Optional[ctypes.c_uint64] = None) -> None:
        self.name, self.seed, self.get, self.put = name, seed, get, put
        self.readers, self.regions, self.extra, self.initial_seed = readers, regions, extra, initial_seed
        self.views = [memoryview((ctypes.c_uint8 * n).from_address(a)).cast("B") for a, n in regions]

    def fingerprint(self) -> Tuple[Any, ...]:
        return tuple(map(operator.call, self.readers))

    def copy(self) -> Tuple[List[bytes], Any]:
        return [bytes(v) for v in self.views], (self.extra[0]() if self.extra else None)

    def put_back(self, copied: Tuple[List[bytes], Any]) -> None:
        data, extra = copied
        for view, part in zip(self.views, data):
            view[:] = part
        if self.extra:
            self.extra[1](extra)


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


def _read(obj: Any, name: str = "value") -> Callable[[], Any]:
    """A C callable reading ``obj.<name>``."""
    return functools.partial(getattr, obj, name)


def _words_at(address: int, size: int) -> Tuple[Callable[[], int], ...]:
    """C callables reading the ``size`` bytes at ``address`` as 8-byte words."""
    return tuple(_read(ctypes.c_uint64.from_address(address + i)) for i in range(0, size, 8))


def _torch_fields(base: int) -> Tuple[ctypes.c_uint64, Tuple[Callable[[], Any], ...]]:
    """The seed field and the readers of a CPU generator whose data starts at ``base``: next_ and
    state_[0], and the cached normal samples."""
    return (ctypes.c_uint64.from_address(base),
            (_read(ctypes.c_uint64.from_address(base + 16)),) + _words_at(base + _TORCH_BYTES - 32, 32))


def _torch_generator() -> _Generator:
    g = torch.default_generator
    fallback = _Generator("torch", g.manual_seed, g.get_state, g.set_state)
    try:
        probe = torch.Generator()                   # the layout, checked on a generator of its own
        probe.manual_seed(12345)
        torch.randn(3, generator=probe)             # a normal cached
        base = _torch_layout(probe)
        if base is None:
            return fallback
        offset = base - ctypes.c_void_p.from_address(id(probe) + 16).value
        if not _inside_allocation(base - offset, offset + _TORCH_BYTES):
            return fallback
        seed_field, readers = _torch_fields(base)

        def fingerprint() -> Tuple[Any, ...]:
            return tuple(map(operator.call, readers))

        def expected(gen: torch.Generator) -> Tuple[int, int]:
            raw = np.frombuffer(gen.get_state().numpy().tobytes(), np.uint64, 4)   # seed, left|seeded, next, state[0]
            return int(raw[0]), int(raw[2]) | int(raw[3]) << 32

        def seen() -> Tuple[int, int]:
            return seed_field.value, fingerprint()[0]

        before = fingerprint()
        torch.randn(1, generator=probe)             # the cached normal used: no word drawn
        if fingerprint() == before or seen() != expected(probe) or not _round_trips(
                ((base, _TORCH_BYTES),), probe.get_state,
                lambda: (torch.randn(1, generator=probe), torch.rand(5, generator=probe))):
            return fallback
        base = ctypes.c_void_p.from_address(id(g) + 16).value + offset
        seed_field, readers = _torch_fields(base)
        if seen() != expected(g):
            return fallback
        return _Generator("torch", g.manual_seed, g.get_state, g.set_state, readers, ((base, _TORCH_BYTES),),
                          initial_seed=seed_field)
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
    fallback = _Generator("numpy", lambda s: np.random.seed(s & 0xFFFFFFFF), np.random.get_state,
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
        if not _round_trips(((address, _MT_BYTES + 4), (gauss, 16)), probe.get_state,
                            lambda: probe.standard_normal(3)):
            return fallback
        address, gauss = rs._bit_generator.ctypes.state_address, id(rs) + offset
        mark = ctypes.c_uint64.from_address(address + _MT_BYTES - 4)   # key[623], pos
        _, keys, pos, has_gauss, value = rs.get_state()
        if (mark.value != int(keys[623]) | int(pos) << 32 or _numpy_gauss(rs) != gauss
                or (ctypes.c_int.from_address(gauss).value, ctypes.c_double.from_address(gauss + 8).value)
                != (has_gauss, value)):
            return fallback
        return _Generator("numpy", fallback.seed, np.random.get_state, np.random.set_state,
                          (_read(mark),) + _words_at(gauss, 16), ((address, _MT_BYTES + 4), (gauss, 16)))
    except Exception:
        return fallback


def _python_generator() -> _Generator:
    inst = random._inst  # type: ignore[attr-defined]
    fallback = _Generator("python", random.seed, random.getstate, random.setstate)
    try:
        probe = random.Random(0)          # CPython's generator object: the position, then the words
        if not _round_trips(((id(probe) + 16, 4 + _MT_BYTES),), probe.getstate, lambda: probe.random()):
            return fallback
        base = id(inst)
        mark = ctypes.c_uint64.from_address(base + 16)                  # position, state[0]
        last = ctypes.c_uint32.from_address(base + 16 + _MT_BYTES)      # state[623]
        _, state, _ = random.getstate()
        if mark.value != state[-1] | state[0] << 32 or last.value != state[623]:
            return fallback

        def put_gauss(value: Any) -> None:
            inst.gauss_next = value

        return _Generator("python", random.seed, random.getstate, random.setstate,
                          (_read(mark), _read(last), _read(inst, "gauss_next")), ((base + 16, 4 + _MT_BYTES),),
                          (_read(inst, "gauss_next"), put_gauss))
    except Exception:  # another interpreter: seeded for every item
        return fallback


class _Generators:
    """This process's global generators, and which of them items were seen to use.

    One *stamp* (a tuple read by C callables only) holds every watched generator's readers,
    those not yet seeded first, then torch's initial seed: comparing two stamps tells whether a
    batch drew from a generator not yet seeded, and whether a generator changed since its state
    was last copied.
    """

    def __init__(self) -> None:
        self.all = (_torch_generator(), _numpy_generator(), _python_generator())
        self.watches = {g.name: g.readers or None for g in self.all}   # None: cannot be watched
        self.seeded = {g.name: not g.readers for g in self.all}
        self._others = tuple(g for g in self.all if not g.readers)     # saved through get/put
        self._copied: Optional[Tuple[Tuple[Any, ...], List[Any]]] = None   # (stamp, copies) of the last copy
        self._update()

    def _update(self) -> None:
        self.seeders = tuple(g.seed for g in self.all if self.seeded[g.name])
        self.watched = tuple(g for g in self.all if not self.seeded[g.name])
        torch_generator = self.all[0]
        self.initial_seed = None if self.seeded["torch"] else torch_generator.initial_seed
        order = self.watched + tuple(g for g in self.all if self.seeded[g.name] and g.readers)
        readers: List[Callable[[], Any]] = []
        self._parts: List[Tuple[_Generator, slice]] = []
        for g in order:
            self._parts.append((g, slice(len(readers), len(readers) + len(g.readers))))
            readers += g.readers
        self._watched_end = sum(len(g.readers) for g in self.watched)
        if torch_generator.initial_seed is not None:
            readers.append(_read(torch_generator.initial_seed))
        self._readers = tuple(readers)
        self._copied = None

    def stamp(self) -> Tuple[Any, ...]:
        return tuple(map(operator.call, self._readers))

    def load(self, dataset: Any, keys: List[Any], seed: int, main: bool) -> List[Any]:
        """``dataset[index]`` of each ``(index, epoch)`` key, drawn from generators seeded from
        (seed, epoch, index) (a plain index is loaded as is). A batch that drew from a generator
        not yet seeded is loaded again with it seeded (and from then on it is seeded for every
        item). In the main process (``main``) every generator is left as it was found."""
        while True:
            readers, others = self._readers, self._others
            before = tuple(map(operator.call, readers))
            if main:
                # Copies of the states are kept and used again while the stamp says nothing
                # changed since they were made: copying 7.5 KB of states the loader does not
                # otherwise touch, every batch, cost more than the rest of the seeding together.
                if self._copied is None or self._copied[0] != before:
                    self._copied = (before, [g.copy() for g, _ in self._parts])
                copied, saved = self._copied, [g.get() for g in others] if others else ()
            try:
                items = self._load(dataset, keys, seed)
            finally:
                after = tuple(map(operator.call, readers))
                if main and (after != before or saved):
                    self._restore(before, after, copied[1], saved)
            end = self._watched_end
            if before[:end] == after[:end]:
                return items
            for g, part in self._parts:    # drew from a generator not seeded: seeded from now on
                if not self.seeded[g.name] and before[part] != after[part]:
                    self.seeded[g.name] = True
            self._update()

    def _load(self, dataset: Any, keys: List[Any], seed: int) -> List[Any]:
        seeders, initial_seed = self.seeders, self.initial_seed
        found = initial_seed.value if initial_seed is not None else None
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
        if initial_seed is not None:
            initial_seed.value = found
        return items

    def _restore(self, stamp: Tuple[Any, ...], now: Tuple[Any, ...], copies: List[Any], others: Any) -> None:
        """Put back each generator whose part of the stamp changed, and torch's initial seed."""
        torch_generator = self.all[0]
        if torch_generator.initial_seed is not None:
            torch_generator.initial_seed.value = stamp[-1]
        for (g, part), copied in zip(self._parts, copies):
            if now[part] != stamp[part]:
                g.put_back(copied)
        for g, state in zip(self._others, others):
            g.put(state)


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
        # a worker's generators are its own; the main process's are the training's too
        return generators.load(self.dataset, keys, self.seed, torch.utils.data.get_worker_info() is None)
