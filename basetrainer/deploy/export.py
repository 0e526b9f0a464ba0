"""Export a model to several formats, check each against eager PyTorch, time them: :func:`export_model`.

Everything that can be refused is refused before a file is written: an unknown format, a
runtime that is not installed, a checkpoint that is missing or holds weights of another
architecture, an input size the model cannot take. Then each format is converted into a staging
folder, run on the check images, compared with eager PyTorch (:mod:`.parity`), and only moved to
its final path when it is within its bound; a conversion that fails, or an export outside its
bound, leaves no file there, and the others go on. The run ends with the table (and JSON) and,
when any format failed, an error.

Example::

    from basetrainer.deploy.export import export_model

    report = export_model("work_space/digits/model/last.pth", "onnx,mnn,ncnn,openvino",
                          check="data/digits/val")
    print(report.to_markdown())
"""
import logging
import os
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

from basetrainer.deploy import data as image_data
from basetrainer.deploy import inputs
from basetrainer.deploy.files import Staging, size_of, staging
from basetrainer.deploy.formats import HARDWARE, Job, check_installed, parse_formats, weight_bytes
from basetrainer.deploy.latency import interleaved
from basetrainer.deploy.onnx_format import ExportError, pick_exporter
from basetrainer.deploy.parity import BOUNDS, Bound, ParityError, compare, failures, find_class_outputs
from basetrainer.deploy.report import ExportReport, Row
from basetrainer.deploy.runtimes import require
from basetrainer.deploy.source import load_model
from basetrainer.runtime import atomic, run_folder

logger = logging.getLogger(__name__)


class ExportFailed(ExportError):
    """A format could not be converted (its row says why); ``report`` holds the whole run."""


def export_model(source: Union[str, nn.Module, Any], formats: Union[str, Sequence[str]] = "onnx",
                 out_dir: Optional[str] = None, input_size: Optional[Sequence[int]] = None,
                 net_type: Optional[str] = None, num_classes: Optional[int] = None, pruned: Optional[str] = None,
                 weights: str = "model", check: Any = None, check_limit: Optional[int] = None,
                 calibration: Any = None, calibration_images: int = 200,
                 mean: Sequence[float] = image_data.DEFAULT_MEAN, std: Sequence[float] = image_data.DEFAULT_STD,
                 batch: int = 37, simplify: bool = True, exporter: str = "auto", opset: Optional[int] = None,
                 runs: int = 20, warmup: int = 3, threads: Optional[int] = None, name: Optional[str] = None,
                 strict: bool = True, dynamic: bool = True, input_names: Sequence[str] = ("input",),
                 output_names: Sequence[str] = ("output",), report_files: bool = True,
                 class_outputs: Optional[Sequence[int]] = None, channels: Optional[int] = None,
                 input_shape: Optional[Sequence[int]] = None) -> ExportReport:
    """Export ``source`` to ``formats`` in ``out_dir``, checked on ``check``, and return the report.

    Args:
        source: a model (wrappers are looked through) or a checkpoint file (see :mod:`.source`).
        formats: names of :data:`basetrainer.deploy.formats.FORMATS`, a list or ``"onnx,mnn"``.
        out_dir: where the files go (default: ``export/`` beside the checkpoint, or ``./export``).
        input_size: ``[W, H]`` (default: the size the checkpoint's run trained at).
        net_type, num_classes, pruned, weights: how to build the model from a file (see
            :func:`basetrainer.deploy.source.load_model`).
        check: an ImageFolder of validation images, or an ``(N, C, H, W)`` array; ``None``: 16
            random inputs (no accuracy then).
        check_limit: use at most this many of the check images (a fixed subset).
        calibration, calibration_images: the training ImageFolder (or array) that int8 is
            calibrated on, and how many of its images (default: the ``train`` folder beside a
            ``check`` folder, when there is one).
        mean, std: the normalisation the model was trained with.
        batch: the batch N of the dynamic-batch check and of the second latency column.
        simplify, exporter, opset: ONNX options (see :mod:`.onnx_format`).
        runs, warmup: timed and untimed rounds of the latency table (0 runs: no timing).
        threads: threads of every runtime and of eager PyTorch (default: torch's).
        name: the files' base name (default: the checkpoint's, or ``model``).
        strict: raise when a format failed (after writing the report).
        dynamic: the exported batch axis is dynamic (``False``: a fixed batch of 1).
        input_names, output_names: the ONNX graph's names.
        report_files: write ``<name>.export.json`` and ``.md`` into ``out_dir``.
        class_outputs: the indices of the outputs that hold class scores (``[]``: none); top-1
            agreement and accuracy are checked on these only. Default: the outputs ``[N, C, ...]``
            with ``C`` = ``num_classes`` (given, or the checkpoint's run's), else the check folder's
            class count (see :func:`basetrainer.deploy.parity.find_class_outputs`).
        channels: the image's channels (default: found by probing the forward pass: those with
            which the first layer the image reaches gets the channels it takes; see
            :mod:`.inputs`). A value with which it does not is an error.
        input_shape: the shape of one input without the batch axis, for a model whose input is
            not an image (``[16]``: an MLP on 16 features); default: a check array's that is not
            ``(N, C, H, W)``. Given, ``input_size`` and ``channels`` do not apply.

    Raises:
        ValueError, FileNotFoundError, MissingRuntimeError: bad input, before any file is written.
        FolderError: (an OSError) ``out_dir`` is a file, under one, or not writable.
        ParityError: a format disagrees with eager PyTorch beyond its bound (``.report`` attached).
        ExportFailed: a format could not be converted (``.report`` attached).
    """
    chosen = parse_formats(formats)
    out_dir = out_dir or _default_out_dir(source)
    run_folder.check_writable(out_dir, key="out_dir")   # before the model is loaded (seconds), not at the write
    check_installed(chosen, simplify)
    if any(f.name not in HARDWARE and "onnx" in f.modules for f in chosen) and pick_exporter(exporter, opset) == "dynamo":
        require("onnxscript")
    inputs.check_counts(batch=batch, runs=runs, warmup=warmup, calibration_images=calibration_images,
                        threads=threads, check_limit=check_limit)
    src = load_model(source, net_type, num_classes, list(input_size) if input_size else None, pruned, weights)
    inputs.check_one_input(src.model)
    input_shape = inputs.sample_shape(input_shape, check, input_size, channels)
    if input_shape is None:   # an image (N, C, H, W)
        size = inputs.input_size(input_size, src.input_size)
        channels, guessed = inputs.channels_of(src.model, size, channels)
        shape: Tuple[int, ...] = (1, channels, size[1], size[0])
    else:
        size, guessed, shape = None, False, (1, *input_shape)
    inputs.check_forward(src.model, shape, src.input_size, guessed)
    images = _images(check, shape, check_limit, mean, std)
    reference = _eager(src.model, images.inputs)
    scores = find_class_outputs(reference, class_outputs, src.num_classes,
                                len(images.classes) if images.labels is not None else None)
    names = [str(n) for n in output_names] if len(output_names) == len(reference) else None
    calib = _calibration(calibration, check, chosen, shape, calibration_images, mean, std)
    stem = name or (os.path.splitext(os.path.basename(os.fspath(source)))[0]
                    if isinstance(source, (str, os.PathLike)) else (src.net_type or "model"))
    threads = threads or torch.get_num_threads()
    report = ExportReport(src.description, list(shape), f"{len(images.inputs)} {images.source}")
    eager = Row("pytorch", "PyTorch (eager)", "fp32", files=[os.fspath(source)] if isinstance(source, (str, os.PathLike))
                else [], size_bytes=weight_bytes(src.model),
                parity=compare(reference, reference, images.labels, scores, names).as_dict())
    report.rows.append(eager)
    report.inputs, report.runners = images.inputs, {"pytorch": _eager_runner(src.model)}
    with staging(out_dir) as stage:
        job = Job(src.model, shape, stage, stem, exporter, opset, simplify, calib, dynamic,
                  (tuple(input_names), tuple(output_names)))
        for fmt in chosen:
            row = Row(fmt.name, fmt.runtime, fmt.precision, BOUNDS[fmt.precision].describe(bool(scores)))
            report.rows.append(row)
            try:   # in a folder of its own: removed after, and a full disk is one DiskFullError
                with stage.attempt(f"the {fmt.name} files", job.weight_bytes) as own:
                    engine = _export_one(fmt, job, own, row, images, (reference, scores, names), batch, threads,
                                         out_dir)
            except Exception as e:   # one format's failure must not stop the others
                logger.debug("%s failed", fmt.name, exc_info=True)
                row.status, row.problems = "error", [f"{type(e).__name__}: {e}"]
                continue
            if engine is not None:
                report.runners[fmt.name] = engine
    if runs:
        time_reports([report], batch, runs, warmup, threads)
    for out in report.rows[0].parity["outputs"]:
        if out["nonfinite_reference"]:
            report.notes.append(f"the model's output {out['name']} holds {out['nonfinite_reference']} NaN or infinite "
                                f"values on the check inputs: the exports must give the same there")
    if size and src.input_size and list(src.input_size) != list(size):
        report.notes.append(f"exported at {size[0]}x{size[1]}; the run trained at {src.input_size[0]}x{src.input_size[1]}")
    unwritten = None
    if report_files:
        try:
            paths = report.write(os.path.join(out_dir, f"{stem}.export.json"),
                                 os.path.join(out_dir, f"{stem}.export.md"))
            logger.info("export report: %s", ", ".join(paths))
        except atomic.DiskFullError as e:   # the table is still shown (and returned)
            unwritten = f"the report files were not written: {e.strerror}"
            report.notes.append(unwritten)
            logger.error("%s", unwritten)
    if strict and not report.ok:
        _raise(report)
    if strict and unwritten:
        error = ExportFailed(f"export failed: {unwritten}")
        error.report = report   # type: ignore[attr-defined]
        raise error
    return report


def _export_one(fmt: Any, job: Job, stage: Staging, row: Row, images: Any,
                expected: Tuple[List[np.ndarray], Sequence[int], Any], batch: int, threads: int, out_dir: str) -> Any:
    reference, scores, names = expected   # the model's outputs, which hold class scores, their names
    staged = fmt.write(job, stage)
    engine = fmt.load(staged, threads)
    bound = BOUNDS[fmt.precision]
    parity = compare(reference, engine(images.inputs), images.labels, scores, names, bound.part_floor)
    # the export at batch N against itself one sample at a time, by the same rule, every output
    part = images.inputs[:batch]
    parts = [engine(part[i:i + 1]) for i in range(len(part))]
    alone = [np.concatenate([p[k] for p in parts], axis=0) for k in range(len(parts[0]))]
    batched = compare(alone, engine(part), names=names)
    parity.batch_max_abs = batched.max_abs
    row.parity = parity.as_dict()
    row.problems = failures(parity, bound)
    row.problems += [f"batch of {len(part)} against one sample at a time: {p}"
                     for p in failures(batched, Bound(rel=bound.rel))]
    if row.problems:
        full = stage.space_error()   # files that load but disagree: cut short by a full disk?
        if full is not None:
            raise full
        row.status = "FAIL"
        logger.error("%s is outside its bound (%s): %s; not written", fmt.name, row.bound, "; ".join(row.problems))
        return None
    row.files = stage.publish([(s, os.path.join(out_dir, os.path.basename(s))) for s in staged])
    row.files = row.files[::-1] if len(row.files) > 1 else row.files    # the file naming the others first
    row.size_bytes = size_of(row.files)
    worst = parity.worst
    logger.info("%s: %s (max |Δ| %.3g, %.2g of the scale of output %s%s)", fmt.name, ", ".join(row.files),
                parity.max_abs, worst.rel if worst else 0.0, worst.name if worst else "-",
                "" if parity.agreement is None else f", top-1 agreement {parity.agreement:.2%}")
    return engine


def _images(check: Any, shape: Sequence[int], limit: Optional[int], mean: Sequence[float],
            std: Sequence[float]) -> image_data.Images:
    if check is None:
        return image_data.random_images(shape)
    if isinstance(check, image_data.Images):
        return check
    if isinstance(check, (str, os.PathLike)) or (isinstance(check, (list, tuple)) and check
                                                  and all(isinstance(c, (str, os.PathLike)) for c in check)):
        roots = os.fspath(check) if isinstance(check, (str, os.PathLike)) else [os.fspath(c) for c in check]
        if len(shape) != 4:
            raise ValueError(f"check={roots!r} is a folder of images, and the model's input is {tuple(shape[1:])} "
                             f"(input_shape): pass the check inputs as an array (N, {', '.join(map(str, shape[1:]))})")
        return image_data.load_images(roots, [shape[3], shape[2]], limit, mean, std, shape[1])
    array = check.detach().cpu().numpy() if isinstance(check, torch.Tensor) else np.asarray(check, dtype=np.float32)
    if array.ndim != len(shape) or tuple(array.shape[1:]) != tuple(shape[1:]):
        raise ValueError(f"check inputs of shape {array.shape} do not fit the model's input "
                         f"(N, {', '.join(map(str, shape[1:]))})")
    return image_data.Images(np.ascontiguousarray(array[:limit], dtype=np.float32), None, [], "given inputs")


def _calibration(calibration: Any, check: Any, chosen: Sequence[Any], shape: Sequence[int], count: int,
                 mean: Sequence[float], std: Sequence[float]) -> Optional[np.ndarray]:
    if not any(f.name == "onnx-int8" for f in chosen):
        return None
    if calibration is None and isinstance(check, (str, os.PathLike)):
        beside = os.path.join(os.path.dirname(os.path.abspath(os.fspath(check))), "train")
        if os.path.isdir(beside) and os.path.abspath(beside) != os.path.abspath(os.fspath(check)):
            logger.info("int8: calibrating on %d images of %s (the train folder beside the check folder)", count, beside)
            calibration = beside
    if calibration is None:
        raise ValueError("onnx-int8 is calibrated on training images: pass calibration=<train ImageFolder> "
                         "(--calibration data/digits/train)")
    return _images(calibration, shape, count, mean, std).inputs


def _eager(model: nn.Module, x: np.ndarray, chunk: int = 64) -> List[np.ndarray]:
    parts: List[List[np.ndarray]] = []
    with torch.inference_mode():
        for i in range(0, len(x), chunk):
            n = len(x[i:i + chunk])
            out = model(torch.from_numpy(x[i:i + chunk]))
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            if not all(isinstance(o, torch.Tensor) for o in outs):
                raise ValueError(f"{type(model).__name__} returns {type(out).__name__}: export needs a model that "
                                 f"returns a tensor or a tuple of tensors")
            for k, o in enumerate(outs):   # the exports are run and checked batch by batch, sample by sample
                if o.dim() == 0 or o.shape[0] != n:
                    raise ValueError(f"output {k} of {type(model).__name__} has shape {tuple(o.shape)} for a batch of "
                                     f"{n}: export needs outputs with the batch first, [N, ...] (one row per "
                                     f"image); return the per-image values and reduce them after the model")
            parts.append([o.float().numpy() for o in outs])
    return [np.concatenate([p[k] for p in parts], axis=0) for k in range(len(parts[0]))]


def _default_out_dir(source: Any) -> str:
    if isinstance(source, (str, os.PathLike)):
        return os.path.join(os.path.dirname(os.path.abspath(os.fspath(source))), "export")
    return "export"


def time_reports(reports: Sequence[ExportReport], batch: int = 37, runs: int = 20, warmup: int = 3,
                 threads: Optional[int] = None) -> None:
    """Time eager PyTorch and every passing export of ``reports`` (made with ``runs=0``) in one
    interleaved loop, at batch 1 and batch ``batch``, on the first report's check images; the
    figures go into each row's ``latency`` (so two exports, e.g. dense and pruned, compare fairly)."""
    inputs = reports[0].inputs
    threads = threads or torch.get_num_threads()
    big = np.concatenate([inputs] * (batch // len(inputs) + 1))[:batch] if len(inputs) < batch else inputs[:batch]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for key, x in (("batch 1", inputs[:1]), (f"batch {batch}", big)):
            contenders = {(i, name): (lambda run=run, a=np.ascontiguousarray(x): run(a))
                          for i, report in enumerate(reports) for name, run in report.runners.items()}
            for (i, name), latency in interleaved(contenders, runs, warmup, batch=len(x), pause_s=0.05).items():
                next(r for r in reports[i].rows if r.format == name).latency[key] = latency.as_dict()
    finally:
        torch.set_num_threads(before)
    for report in reports:
        report.timing = {"threads": threads, "runs": runs, "warmup": warmup}
        report.notes.append(f"latency: eager PyTorch and the exports take turns, one call each per round, with a "
                            f"50 ms untimed pause before each call (runtimes' threads spin after a call)")


def _eager_runner(model: nn.Module) -> Any:
    def run(x: np.ndarray) -> None:
        with torch.inference_mode():
            model(torch.from_numpy(x))
    return run


def _raise(report: ExportReport) -> None:
    lines = [f"{row.format}: {'outside its bound' if row.status == 'FAIL' else 'not exported'}: "
             f"{'; '.join(row.problems)}" for row in report.failed]
    error = (ParityError if any(r.status == "FAIL" for r in report.failed) else ExportFailed)(
        "export failed for " + " | ".join(lines))
    error.report = report   # type: ignore[attr-defined]
    raise error
