"""Per-sample outputs streamed to a ``.npy``, ``.npz`` or ``.csv`` file in bounded memory.

A writer takes the outputs chunk by chunk, in dataset order (what
:class:`~basetrainer.evaluation.ordered.OrderedCollector` yields), and holds about one chunk in
memory, whatever the total. Each output is spooled to a raw file beside the target while it
comes (the row count, hence the shape, is known only at the end), and the file is put together
at :meth:`~PredictionWriter.close` by copying the spool files in 8 MB pieces:

- ``.npy``: one output, no ids: the file :func:`numpy.lib.format.open_memmap` lays out for the
  final shape; ``numpy.load(path, mmap_mode="r")`` maps it (``torch.from_numpy`` makes it a
  tensor);
- ``.npz``: one ``<name>.npy`` member per output (:func:`numpy.load` reads it), each a
  ``numpy.lib.format`` header of the final shape followed by the rows, plus ``ids.npy``;
- ``.csv``: one row per sample, written as it comes: ``index`` (the sample's position in the
  data set), ``id`` (when given, e.g. the image file), then one column per value (``logits_0``,
  ``logits_1``, ...). Floats are written with enough digits to read back bit for bit
  (float32: 9 significant digits, float64: 17).

bfloat16 outputs (``amp: bf16``), which numpy has no dtype for, are written to ``.npy`` and
``.npz`` as float32, which holds each of their values exactly.

The file appears at its path only when complete (built under a temp name, then linked into
place by the runtime's atomic writer): a failure or a kill leaves the previous file as it was.
A full disk is a :class:`~basetrainer.runtime.atomic.DiskFullError` naming the folder.
"""
import errno
import os
import zipfile
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from basetrainer.evaluation.ordered import flatten, signature
from basetrainer.runtime import atomic

_PIECE = 8 << 20          # bytes copied at a time when the archive is put together
_CSV_VALUES = 1 << 16     # values formatted at a time in a CSV chunk


class PredictionWriter:
    """Base of the writers: checks every chunk against the first (names, dtypes, row shapes),
    counts the rows, and publishes the file atomically. Use :func:`open_writer`.

    Use as a context manager (an exception inside leaves no file and no temp), or call
    :meth:`write` then :meth:`close` (:meth:`abort` on failure).
    """

    suffix = ""

    def __init__(self, path: str) -> None:
        check_path(path)
        self.path = os.path.abspath(path)
        self.folder = os.path.dirname(self.path)
        os.makedirs(self.folder, exist_ok=True)
        self._remove_leftovers()
        self.temp = atomic.temp_path(self.path + ".part")   # (temp_path(path) is the link's name)
        self.spec: Any = None
        self.sig: Optional[list] = None
        self.rows = 0
        self.ids: Optional[List[str]] = None
        self.closed = False
        self._temps: List[str] = [self.temp]

    # ------------------------------------------------------------------ public
    def write(self, outputs: Any, ids: Optional[Sequence[Any]] = None) -> None:
        """Append a chunk of outputs (one row per sample, in dataset order).

        Args:
            outputs: a tensor, a numpy array, or tuples/lists/dicts of them.
            ids: one name per sample (e.g. its file), given with every chunk or with none.

        Raises:
            ValueError: a chunk whose structure, dtypes or row shapes differ from the first,
                or ids not one per sample.
        """
        if self.closed:
            raise RuntimeError(f"the writer of {self.path} is closed")
        named, spec = flatten(outputs)
        n = len(next(iter(named.values())))
        if ids is not None:
            ids = [str(i) for i in ids]
            if len(ids) != n:
                raise ValueError(f"ids: {len(ids)} given for a chunk of {n} samples: give one id per sample")
        if self.sig is None:
            self.spec, self.sig = spec, signature(named)
            self.ids = [] if ids is not None else None
            self._guarded(lambda: self._begin(named))
        elif signature(named) != self.sig:
            raise ValueError(f"{os.path.basename(self.path)}: this chunk's outputs (names, dtype, row shape) "
                             f"{signature(named)} differ from the first chunk's {self.sig}: the structure must "
                             f"stay the same")
        if (ids is None) != (self.ids is None):
            raise ValueError("ids must be given with every chunk or with none")
        named = {k: v.detach().cpu().contiguous() for k, v in named.items()}
        self._guarded(lambda: self._write(named, ids, self.rows))
        if ids is not None:
            self.ids.extend(ids)
        self.rows += n

    def close(self) -> str:
        """Finish the file and put it at its path; return the path."""
        if self.closed:
            return self.path
        if self.sig is None:
            self.abort()
            raise ValueError(f"nothing was written to {self.path}: no outputs were given")
        try:
            self._guarded(self._finish)
            self._publish()
        finally:
            self.abort()
        return self.path

    def abort(self) -> None:
        """Remove the temp and spool files; the file at the path stays as it was."""
        self.closed = True
        self._release()
        for path in self._temps:
            try:
                os.remove(path)
            except OSError:
                pass

    def __enter__(self) -> "PredictionWriter":
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    # ------------------------------------------------------------------ helpers
    def _remove_leftovers(self) -> None:
        """Temp and spool files of a killed writer of this file (this machine, process gone)."""
        prefix = f".{os.path.basename(self.path)}."
        for path in atomic.stale_temps(self.folder):
            if os.path.basename(path).startswith(prefix):
                try:
                    os.remove(path)
                except OSError:
                    pass

    def _spool_path(self, k: int) -> str:
        path = atomic.temp_path(f"{self.path}.{k}")
        self._temps.append(path)
        return path

    def _guarded(self, fn: Any) -> None:
        """Run ``fn``; a full disk becomes one DiskFullError naming the folder (temps removed)."""
        try:
            fn()
        except OSError as e:
            if atomic.space_error(e) is None:
                self.abort()
                raise
            self.abort()
            raise atomic.DiskFullError(errno.ENOSPC, f"no space left in {self.folder}: writing "
                                                     f"{os.path.basename(self.path)} ({self.rows} rows so far); "
                                                     f"the file at that path is left as it was") from None
        except BaseException:
            self.abort()
            raise

    def _publish(self) -> None:
        try:
            atomic.link_atomically(self.temp, self.path)
        except OSError as e:
            if atomic.space_error(e) is not None:
                raise
            with open(self.temp, "rb") as f:   # no hard links on this file system: a copy
                atomic.write_atomically(f.read(), self.path)

    # ------------------------------------------------------------------ per format
    def _begin(self, named: Dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def _write(self, named: Dict[str, torch.Tensor], ids: Optional[List[str]], start: int) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        """Close open files (before they are removed)."""


def _close_quietly(f: Any) -> None:
    """Close a file that is about to be removed (its unwritten buffer may not fit: no matter)."""
    try:
        f.close()
    except OSError:
        pass


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, in row-major order (no copy when its elements are laid out one
    after another). A tensor torch calls contiguous may still have a flat view of stride > 1 (a
    [1] slice ``probs[:, 1]`` of a one-row batch has stride 2: one element, so contiguous), which
    cannot be viewed as bytes: such a view is copied to a fresh stride-1 one."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.stride(0) != 1:
        flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)
    return memoryview(flat.view(torch.uint8).numpy())


class _Spooled(PredictionWriter):
    """Each output's bytes go to its own raw file; :meth:`_finish` puts the archive together."""

    def _begin(self, named: Dict[str, torch.Tensor]) -> None:
        self.files = {}
        for k, name in enumerate(named):
            path = self._spool_path(k)
            self.files[name] = (path, open(path, "wb"))

    def _write(self, named: Dict[str, torch.Tensor], ids: Optional[List[str]], start: int) -> None:
        for name, t in named.items():
            if t.dtype == torch.bfloat16:   # numpy has no bfloat16: float32 holds every value exactly
                t = t.float()
            self.files[name][1].write(_raw(t))

    def _release(self) -> None:
        for _, f in getattr(self, "files", {}).values():
            _close_quietly(f)

    def _flush(self) -> None:
        for _, f in self.files.values():
            f.close()

    @staticmethod
    def _copy(source: str, member: Any) -> None:
        with open(source, "rb") as f:
            while True:
                piece = f.read(_PIECE)
                if not piece:
                    break
                member.write(piece)

    def _shape(self, name: str) -> tuple:
        row = next(s for n, _, s in self.sig if n == name)
        return (self.rows,) + tuple(row)


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """numpy's dtype for a torch dtype; bfloat16, which numpy lacks, is written as float32 (the
    outputs of ``predict()`` under ``amp: bf16``: every bfloat16 value is a float32 value)."""
    if dtype == torch.bfloat16:
        return np.dtype(np.float32)
    return torch.empty(0, dtype=dtype).numpy().dtype


class NpzWriter(_Spooled):
    """``.npz``: one ``<name>.npy`` per output, plus ``ids.npy`` when ids were given."""

    suffix = ".npz"

    def _begin(self, named: Dict[str, torch.Tensor]) -> None:
        if self.ids is not None and "ids" in named:
            raise ValueError("an output named 'ids' and ids given: rename the output")
        super()._begin(named)

    def _finish(self) -> None:
        self._flush()
        with zipfile.ZipFile(self.temp, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
            for name, (path, _) in self.files.items():
                dtype = _numpy_dtype(next(getattr(torch, d.split(".")[-1]) for n, d, _ in self.sig
                                          if n == name))
                header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                          "shape": self._shape(name)}
                with z.open(f"{name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array_header_1_0(member, header)
                    self._copy(path, member)
            if self.ids is not None:
                with z.open("ids.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.array(self.ids, dtype=str), allow_pickle=False)
            fsync(z.fp)


def fsync(f: Any) -> None:
    f.flush()
    os.fsync(f.fileno())


# ----------------------------------------------------------------------------- .npy
class NpyWriter(_Spooled):
    """``.npy``: one array (``numpy.load(path, mmap_mode="r")`` maps it). numpy lays the file out
    (:func:`numpy.lib.format.open_memmap` writes the header of the final shape and sizes the
    file); the spooled rows are then copied into its data region, at the memmap's ``offset``, in
    8 MB pieces (writing through the map would keep every written page in this process' RSS)."""

    suffix = ".npy"

    def _begin(self, named: Dict[str, torch.Tensor]) -> None:
        name = os.path.basename(self.path)
        if len(named) != 1 or self.ids is not None:
            what = f"outputs {list(named)}" if len(named) != 1 else "ids (file names)"
            raise ValueError(f"output={name!r}: a .npy file holds one array, and these are {what}: "
                             f"write a .npz (one array per output, plus ids) or a .csv file")
        super()._begin(named)

    def _finish(self) -> None:
        self._flush()
        (name, (spool, _)), = self.files.items()
        dtype = _numpy_dtype(next(getattr(torch, d.split(".")[-1]) for _, d, _ in self.sig))
        array = np.lib.format.open_memmap(self.temp, mode="w+", dtype=dtype, shape=self._shape(name))
        offset = array.offset
        del array
        with open(self.temp, "r+b") as f:
            f.seek(offset)
            self._copy(spool, f)
            fsync(f)


# ----------------------------------------------------------------------------- .csv
def _cell(text: str) -> str:
    if any(c in text for c in ',"\n\r'):
        return '"' + text.replace('"', '""') + '"'
    return text


def _format_of(dtype: torch.dtype) -> str:
    if dtype == torch.float64:
        return "%.17g"
    if dtype.is_floating_point:
        return "%.9g"   # float32 (half and bfloat16 widen to it exactly) reads back bit for bit
    if dtype.is_complex:
        raise TypeError("complex outputs cannot be written to CSV: write .npy or .npz")
    return "%d"


class CsvWriter(PredictionWriter):
    """``.csv``: ``index``, ``id`` (with ids), then one column per value, row by row."""

    suffix = ".csv"

    def _begin(self, named: Dict[str, torch.Tensor]) -> None:
        columns = ["index"] + (["id"] if self.ids is not None else [])
        formats = []
        for name, t in named.items():
            width = int(np.prod(t.shape[1:], dtype=np.int64))
            fmt = _format_of(t.dtype)
            if t.dim() == 1:
                columns.append(name)
            else:
                columns += [f"{name}_{j}" for j in range(width)]
            formats += [fmt] * width
        self.format = ",".join(formats)
        self.file = open(self.temp, "w", encoding="utf-8", newline="")
        self.file.write(",".join(_cell(c) for c in columns) + "\n")

    def _write(self, named: Dict[str, torch.Tensor], ids: Optional[List[str]], start: int) -> None:
        arrays = []
        for t in named.values():
            t = t.reshape(len(t), -1)
            if t.dtype in (torch.float16, torch.bfloat16):
                t = t.float()
            arrays.append(t.numpy())
        n = len(arrays[0])
        width = sum(a.shape[1] for a in arrays) or 1
        step = max(1, _CSV_VALUES // width)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            rows = [sum((a[i].tolist() for a in arrays), []) for i in range(lo, hi)]
            lines = []
            for i, values in zip(range(lo, hi), rows):
                head = f"{start + i}," + (_cell(ids[i]) + "," if ids is not None else "")
                lines.append(head + self.format % tuple(values))
            self.file.write("\n".join(lines) + "\n")

    def _finish(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

    def _release(self) -> None:
        f = getattr(self, "file", None)
        if f is not None:
            _close_quietly(f)


def check_path(path: str) -> None:
    """Refuse, before anything runs, an output path that cannot become a file: a folder of that
    name (found only when the finished file was put in place), a path under a file, a folder this
    user cannot write into.

    Raises:
        ValueError: naming ``output=``, the path, what stops it and the fix.
    """
    target = os.path.abspath(path)
    if os.path.isdir(target):
        suffix = os.path.splitext(target)[1]
        raise ValueError(f"output={path!r}: {target} is a folder: name a file (e.g. "
                         f"{os.path.join(target, 'predictions' + suffix)!r}), or remove or rename that folder")
    probe = os.path.dirname(target)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"output={path!r}: {probe} is a file, not a folder: write the output elsewhere, or "
                         f"remove or rename that file")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"output={path!r}: {probe} is read-only for this user (or on a read-only disk): "
                         f"write the output into a folder you can write")


FORMATS = {".npy": NpyWriter, ".npz": NpzWriter, ".csv": CsvWriter}


def open_writer(path: str, format: Optional[str] = None) -> PredictionWriter:
    """A writer for ``path``, of the format its suffix names (or ``format``: npy, npz, csv).

    Raises:
        ValueError: an unknown format (the valid ones are named), a path that cannot become a file
            (:func:`check_path`).
    """
    key = ("." + format.lstrip(".").lower()) if format else os.path.splitext(str(path))[1].lower()
    if key == ".pt":
        raise ValueError(f"output={path!r}: outputs are no longer written as .pt: name a .npy file (one "
                         f"output; torch.from_numpy(numpy.load(path, mmap_mode='r'))) or a .npz or .csv file")
    if key not in FORMATS:
        raise ValueError(f"output={path!r}: cannot write {key or 'a file without a suffix'!r}; name a "
                         f"{', '.join(FORMATS)} file (or give format=)")
    return FORMATS[key](path)
