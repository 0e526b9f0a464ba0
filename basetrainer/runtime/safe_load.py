"""Loading a torch file without trusting it: ``weights_only`` (pickled code is refused), every
record checked against the CRC-32 torch stored with it, and the tensors checked to be finite.

The bottom of the checkpoint modules: :mod:`basetrainer.runtime.checkpoint` (one-file
checkpoints) and :mod:`basetrainer.runtime.shard_folders` (the shards of sharded ones) both read
through it.
"""
import os
import pickle
import re
import zipfile
from typing import Any, Dict, List

import torch

from basetrainer.runtime.errors import CheckpointError, PathError


def load_file(path: str, map_location: Any = "cpu") -> Any:
    """Load a ``.pth`` with ``weights_only=True``; every failure names the file and the problem.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: (a ValueError) the file is truncated, damaged (a record differs from its
            stored CRC-32), not a torch file, or carries pickled code (refused).
    """
    if path and os.path.isdir(path):
        raise CheckpointError(f"checkpoint file {path!r} is a folder, not a file: {_file_in(path)}")
    if not path or not os.path.isfile(path):
        raise PathError(f"checkpoint file {path!r} does not exist; check the path "
                        f"(finetune/resume/pretrained keys)")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"checkpoint file {path!r} is empty (0 bytes): it was not written completely")
    bad = crc_errors(path)
    if bad:   # a changed byte of a weight would load as another finite value
        raise CheckpointError(f"checkpoint file {path!r} is damaged: {', '.join(bad[:3])} "
                              f"{'does' if len(bad) == 1 else 'do'} not match the CRC-32 stored when it was "
                              f"written (torch.load does not check it); use another copy (e.g. last.prev.pth)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        # every weights-only failure mentions "weights_only"; only a blocked GLOBAL is pickled code
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = next((line for line in lines if "unsupported" in line.lower()), lines[0] if lines else "")
        if "unsupported global" in str(e).lower():
            raise CheckpointError(f"refused to load {path!r}: it holds pickled Python objects that would run "
                                  f"code when loaded (only tensors, numbers, strings, lists and dicts are "
                                  f"accepted). Re-save it as a plain state_dict. Details: {detail}"
                                  ) from None
        raise _not_a_torch_file(path, detail) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        raise _not_a_torch_file(path, _first_line(e)) from None
    except Exception as e:
        if zipfile.is_zipfile(path):   # a whole torch file (every torch.save since 1.6): a fault of the program
            raise
        # torch's legacy (pre-zip) reader unpickles any other file: text fails it with IndexError,
        # KeyError, ... (/etc/passwd: "IndexError: list index out of range", with a traceback)
        raise _not_a_torch_file(path, _first_line(e)) from None


def _file_in(folder: str) -> str:
    """The fix for a folder given as a checkpoint: a checkpoint file that is there (its
    ``last.pth``, else its newest best, per-epoch or other ``.pth``; a run's work_dir: its
    ``model/last.pth``), never a path that does not exist."""
    for candidate in (os.path.join(folder, "last.pth"), os.path.join(folder, "model", "last.pth")):
        if os.path.isfile(candidate):
            return f"give the file inside it, e.g. {candidate!r}"
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".pth") and os.path.isfile(os.path.join(folder, n))]
    except OSError:
        names = []
    for prefix in ("best_model_", "model_", ""):
        found = sorted((n for n in names if n.startswith(prefix)),
                       key=lambda n: os.path.getmtime(os.path.join(folder, n)))
        if found:
            return f"give the file inside it, e.g. {os.path.join(folder, found[-1])!r}"
    return ("it holds no .pth file: give the path of a checkpoint file (a run's <work_dir>/model/last.pth, "
            "or a best_model_*.pth / model_*.pth weights file)")


def _not_a_torch_file(path: str, detail: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {path!r} is truncated or not a torch file ({detail}); give a file "
                           f"written by torch.save (a checkpoint or a state_dict)")


def _first_line(error: BaseException) -> str:
    """The error's kind and its first sentence, without torch's appeals to report it or miniz's
    paragraph of advice (``Expected hasRecord("version") ...  (Could this error message be improved?``)."""
    text = str(error).splitlines()[0] if str(error) else ""
    text = re.split(r"\s{2,}\(|\. (?=[A-Z])", text, maxsplit=1)[0].rstrip(". ")
    if type(error) in (IndexError, KeyError) or not text:   # the legacy unpickler reading text: no news
        return f"torch.load: {type(error).__name__}"
    return f"{type(error).__name__}: {text[:120]}"


def crc_errors(source: Any) -> List[str]:
    """The records of a torch file (a path or a binary file object) whose bytes differ from the
    CRC-32 torch's writer stored for them; torch.load never checks these, so a flipped bit in a
    weight loads as another finite value. Records stored without a checksum (CRC 0, torch's
    ``set_crc32_options(False)``) and files that are not zip archives (torch's legacy format)
    are not checked. About 1 GB/s."""
    try:
        archive = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, OSError, ValueError):
        return []
    bad = []
    with archive:
        for info in archive.infolist():
            if info.CRC == 0:
                continue
            try:
                with archive.open(info) as f:
                    while f.read(1 << 22):
                        pass
            except zipfile.BadZipFile:
                bad.append(info.filename.split("/", 1)[-1])
            except (OSError, EOFError, RuntimeError, NotImplementedError):
                return bad   # a broken archive: torch.load's own error says so
    return bad



def non_finite(weights: Dict[str, torch.Tensor]) -> List[str]:
    """Names of the floating-point tensors of ``weights`` holding NaN or inf (one host sync)."""
    by_device: Dict[torch.device, List[str]] = {}
    for k, v in weights.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            by_device.setdefault(v.device, []).append(k)
    bad = []
    for names in by_device.values():
        # a sum is NaN or inf when any entry is (about 20x faster than isfinite(t).all() over
        # every tensor); a finite tensor whose sum overflows is told apart by the exact check
        sums = [weights[k].sum(dtype=torch.float64 if weights[k].dtype == torch.float64 else torch.float32)
                for k in names]
        flags = torch.isfinite(torch.stack(sums)).tolist()
        bad += [k for k, ok in zip(names, flags) if not ok and not bool(torch.isfinite(weights[k]).all())]
    return bad
