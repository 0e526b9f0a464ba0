"""``evaluate()`` and ``predict()``: a trained model on a data set, exact over the ranks.

:func:`evaluate` runs the test phase of the loop (``on_test_begin``, a forward of every test
batch with ``on_test_summary``, ``on_test_end``) with the trainer's callbacks, so its recorders
give their test figures reduced over every rank, as at the end of a training epoch; it returns
them (``{"test/<indicator>": value}``). Nothing is trained and no checkpoint is written.

:func:`predict` runs the model over a data set and returns one output per sample in dataset
order: the test sampler's shards (rank r of W holds samples r, r + W, ...) are gathered round by
round and interleaved back (:class:`~basetrainer.evaluation.ordered.OrderedCollector`), so no
padding duplicate and no missing sample, whatever the number of ranks. With ``output=`` the
rows are streamed, one round at a time, to a ``.npz``, ``.npy`` or ``.csv`` file written by the
main process (:mod:`basetrainer.evaluation.writers`): memory does not grow with the data set.

Both may first load weights (``checkpoint=``): a weights file (a best or per-epoch file), a
resumable ``last.pth`` (its model weights), or ``"auto"``, the newest loadable checkpoint of the
run's folder. Under ``strategy: fsdp`` every rank forwards as many times as the others (each
forward gathers parameters from all of them).
"""
import contextlib
import logging
import os
from typing import Any, Callable, Dict, Iterator, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

from basetrainer.engine import inference_data, preemption
from basetrainer.engine.resume import _decided_by_main
from basetrainer.evaluation import ordered, writers
from basetrainer.runtime import checkpoint as checkpoints
from basetrainer.runtime import comm, sharded, sharding, watchdog
from basetrainer.runtime.modules import ModelWithLoss
from basetrainer.utils import torch_tools

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- evaluate
def evaluate(engine: Any, loader: Any = None, checkpoint: Optional[str] = None,
             batch_size: Optional[int] = None) -> Dict[str, Any]:
    """Run the test phase over ``loader`` (default: the trainer's test loader; a data set: a
    test loader of ``batch_size``, default the config's) with the trainer's callbacks and
    return the test figures they wrote (see the module's docstring).

    Raises:
        ValueError: no loader and no test loader, a loader that would count samples twice or
            not at all over the processes (not sharded for them, padded, drop_last: see
            :func:`~basetrainer.dataloader.loader.check_test_shards`), a checkpoint that does
            not fit the model.
        FileNotFoundError: ``checkpoint`` does not exist.
    """
    name = type(engine).__name__
    loader = inference_data.evaluate_loader(engine, loader, batch_size)
    _check_model(engine, "evaluate")
    if engine.criterion is None and _default_run_step(engine):
        raise ValueError(f"{name}.evaluate(): the default run_step needs a criterion (the loss is a test "
                         f"figure): return one from build_criterion, or override run_step")
    _warn_resume_unused(engine, "evaluate", checkpoint)
    logs: Dict[str, Any] = {}
    with engine.evaluation(loader, checkpoint=checkpoint), engine.stall_watchdog():   # a file's weights: no EMA swap
        preemption.shield_loader(loader)
        engine.dispatch("on_test_begin", logs)
        engine.run_test_epoch(engine.epoch, logs)
        engine.dispatch("on_test_end", logs)
    figures = {k: v for k, v in logs.items() if k.startswith("test/")}
    if not figures and comm.is_main_process():
        logger.warning("%s.evaluate(): no callback wrote a test figure: add a recorder to build_callbacks "
                       "(e.g. AccuracyRecorder(), LossesRecorder())", name)
    return figures


# ----------------------------------------------------------------------------- predict
def predict(engine: Any, loader: Any, output: Optional[str] = None, checkpoint: Optional[str] = None,
            transform: Optional[Callable] = None, batch_size: Optional[int] = None) -> Any:
    """The model's outputs for every sample of ``loader``, in dataset order (see the module's
    docstring); with ``output``, the path of the file they were written to.

    Raises:
        ValueError: an ``output`` suffix other than .npz/.npy/.csv, a loader that does not visit
            its data set in order (shuffled, drop_last, padded), a folder holding a file that is
            not an image, a checkpoint that does not fit the model.
        FileNotFoundError: the folder or ``checkpoint`` does not exist.
    """
    if output is not None:
        output = os.fspath(output)
        suffix = os.path.splitext(output)[1].lower()
        if suffix not in writers.FORMATS:
            raise ValueError(f"predict(output={output!r}): cannot write {suffix or 'a file without a suffix'!r}; "
                             f"name a {', '.join(writers.FORMATS)} file")
    loader, names, built = inference_data.predict_loader(engine, loader, transform, batch_size)
    _check_model(engine, "predict")
    _warn_resume_unused(engine, "predict", checkpoint)
    with engine.evaluation(engine.test_loader, checkpoint=checkpoint, what="predict()"), _predict_events(engine), \
            engine.stall_watchdog():   # from the first collective: a rank that never comes is reported
        rounds = max(comm.all_gather_object(len(loader)))   # ranks' shards differ by up to one batch
        # a failure of one rank before the rounds (a rank's workers not starting) is agreed in the first
        # round, as a batch's: no other rank waits for it; the file, opened on the main process only,
        # is agreed at once
        writer, error = None, None
        if output is not None and comm.is_main_process():
            try:
                writer = writers.open_writer(output)   # checks the path: a folder, under a file, read-only
            except Exception as e:
                error = e
        if output is not None:   # before any rank's first forward: a bad path costs no forward
            _agree(error)
        if writer is not None and names is not None:
            writer = _WithIds(writer, names)
        collector = ordered.OrderedCollector(dst=0 if output is not None else None, writer=writer)
        wrapped, training = engine.model, engine.model.training
        engine.model = _forward_model(wrapped)
        engine.model.eval()
        placeholder, result = None, [None]
        progress = watchdog.PROGRESS
        try:
            with torch.no_grad():
                batches = None
                if error is None:
                    try:
                        batches = preemption.start(loader)
                    except Exception as e:
                        error = e
                fsdp = sharding.is_fsdp(engine.model)
                for _ in range(rounds):
                    outputs, batch = None, None
                    if error is None:
                        try:
                            batch = next(batches, None)
                        except Exception as e:
                            error = e
                    if fsdp:   # FSDP's forward all-gathers: a rank that failed to load must not leave it alone
                        _agree(error)
                    if error is None:
                        try:
                            if batch is not None:
                                outputs = _forward(engine, engine.to_device(batch))
                                _check_outputs(outputs, collector, _samples(batch, loader),
                                               unbatched=loader.batch_sampler is None)
                            elif fsdp:   # every rank forwards as often
                                placeholder = placeholder or _placeholder(engine, loader)
                                _forward(engine, placeholder)
                        except Exception as e:
                            error = e
                    _agree(error)   # one collective a round: no rank waits for one that failed
                    progress.count += 1   # the stall watchdog's stamp
                    error = _guarded(collector.add, outputs)   # a writer's failure: on the main process only
                if error is None:
                    error = _guarded(lambda: result.__setitem__(0, collector.finish()))
                _agree(error)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        finally:
            engine.model = wrapped
            engine.model.train(training)
            if built:
                preemption.end_workers(loader)
    if output is None:
        return result[0]
    comm.synchronize()
    return os.path.abspath(output)


@contextlib.contextmanager
def _predict_events(engine: Any) -> Iterator[None]:
    """``on_predict_begin`` and ``on_predict_end`` (also when predict raises) around the body:
    ModelEMA swaps in the weights evaluate() tests, and back."""
    try:
        engine.dispatch("on_predict_begin", {})
        yield
    finally:
        engine.dispatch("on_predict_end", {})


def _warn_resume_unused(engine: Any, what: str, checkpoint: Optional[str]) -> None:
    """A trainer made with ``resume`` that has not run: its model holds build_model's weights,
    not the resumed ones (``resume`` applies to run()); say so once, with the fix."""
    resume = engine.cfg.get("resume") if engine.cfg is not None else None
    if resume and not checkpoint and not engine.runs_done and comm.is_main_process():
        logger.warning("%s.%s(): resume=%r applies to run(), which has not run: the weights used are "
                       "build_model's; pass checkpoint=%r to use the resumed ones", type(engine).__name__, what,
                       resume, resume)


def predict_step(engine: Any, batch: Any) -> Any:
    """The default forward of :func:`predict`: the model on the batch's inputs (a tensor, or the
    first entry of a ``(inputs, ...)`` tuple/list, as the test loader gives them)."""
    if isinstance(batch, torch.Tensor):
        inputs = batch
    elif isinstance(batch, (list, tuple)) and batch:
        inputs = batch[0]
    else:
        raise TypeError(f"the default predict_step takes a tensor or (inputs, ...) batches, got a "
                        f"{type(batch).__name__}: override {type(engine).__name__}.predict_step(self, batch) "
                        f"-> outputs (tensors, or tuples/dicts of them, one row per sample)")
    return engine.model(inputs)


class _WithIds:
    """A writer that adds each row's name (its file), counting the rows written so far."""

    def __init__(self, writer: writers.PredictionWriter, names: Callable[[int], str]) -> None:
        self.writer, self.names, self.done = writer, names, 0

    def write(self, outputs: Any) -> None:
        n = len(next(iter(ordered.flatten(outputs)[0].values())))
        self.writer.write(outputs, ids=[self.names(i) for i in range(self.done, self.done + n)])
        self.done += n

    def close(self) -> str:
        return self.writer.close()

    def abort(self) -> None:
        self.writer.abort()


def _forward(engine: Any, batch: Any) -> Any:
    with engine.autocast():
        step = getattr(engine, "predict_step", None)
        return step(batch) if step is not None else predict_step(engine, batch)


def _samples(batch: Any, loader: DataLoader) -> Optional[int]:
    """The number of samples in a batch the loader gave: 1 when it does not batch
    (``batch_size=None``: each item is a sample), else the length of the inputs (the batch, or
    the first entry of an ``(inputs, ...)`` tuple/list) when they are a tensor, or the length
    its tensors share for a dict batch; None when it cannot be told (a list of strings...)."""
    if loader.batch_sampler is None:
        return 1
    if isinstance(batch, dict):   # {"x": [n, ...], "y": [n]}: n, when the tensors agree
        lengths = {len(v) for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()}
        return lengths.pop() if len(lengths) == 1 else None
    inputs = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    return len(inputs) if isinstance(inputs, torch.Tensor) and inputs.dim() else None


def _check_outputs(outputs: Any, collector: ordered.OrderedCollector, samples: Optional[int] = None,
                   unbatched: bool = False) -> None:
    """What the collector would refuse, refused before its collective (on this rank alone); and
    outputs that are not one row per sample of the batch (``samples``, when it can be told),
    which the collector would take as rows and interleave wrongly over the ranks."""
    named, _ = ordered.flatten(outputs)
    rows = len(next(iter(named.values())))
    if samples is not None and rows != samples:
        hint = "the loader has batch_size=None, so it gives the samples one by one, without a batch " \
                    "dimension: give it a batch_size (or pass the data set); " if unbatched else ""
        raise ValueError(f"predict(): predict_step returned {rows} row{'s' if rows != 1 else ''} for a batch of "
                         f"{samples} sample{'s' if samples != 1 else ''}: {hint}the first dimension of every output "
                         f"is its sample (not a flattened [n * C], a per-batch mean, nor a transposed [C, n]): "
                         f"return one row per sample")
    if collector.sig is not None and ordered.signature(named) != collector.sig:
        raise ValueError(f"predict(): the outputs changed structure, dtype or row shape between batches: "
                         f"{ordered.signature(named)} after {collector.sig}")


def _guarded(fn: Callable, *args: Any) -> Optional[BaseException]:
    try:
        fn(*args)
    except Exception as e:
        return e
    return None


def _agree(error: Optional[BaseException]) -> None:
    """Raise on every rank when one failed (its error there, the same message on the others), so
    that no rank waits in a collective for one that left."""
    if comm.get_world_size() == 1 or not comm.any_true(error is not None):
        if error is not None:
            raise error
        return
    messages = comm.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
    raise RuntimeError(f"predict() failed on rank {rank}: {message}")


def _forward_model(model: nn.Module) -> nn.Module:
    """The module predict forwards through: DDP's forward may talk to the other ranks (which hold
    a different number of batches), so its module; a DataParallel(ModelWithLoss) needs targets,
    so a DataParallel of the model alone."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module
    if isinstance(model, nn.DataParallel) and isinstance(model.module, ModelWithLoss):
        return nn.DataParallel(model.module.model, device_ids=model.device_ids)
    return model


def _placeholder(engine: Any, loader: DataLoader) -> Any:
    dataset = loader.dataset
    collate = loader.collate_fn or torch.utils.data.default_collate
    return engine.to_device(collate([dataset[0]]))


def _check_model(engine: Any, what: str) -> None:
    if engine.model is None:
        raise RuntimeError(f"{type(engine).__name__}.{what}(): no model; build it (build_model) first")


def _default_run_step(engine: Any) -> bool:
    from basetrainer.engine.engine import Engine

    return getattr(type(engine), "run_step", None) is Engine.run_step


# ----------------------------------------------------------------------------- weights
def load_checkpoint(engine: Any, checkpoint: str) -> str:
    """Load the model weights of ``checkpoint`` into ``engine.model`` (every rank calls it):
    a weights file, a resumable checkpoint (its ``model``; a sharded one's shards), or
    ``"auto"``: the newest loadable checkpoint of the run's folder. Only the weights: the
    optimizer, the position and the callbacks' states are left as they are. Returns the path.

    Raises:
        FileNotFoundError: no such file, or no checkpoint in the run's folder (``"auto"``).
        ValueError: a damaged file, or weights that do not fit the model (names what differs).
    """
    path = _decided_by_main(lambda: _find(engine, os.fspath(checkpoint))) if checkpoint == "auto" else \
        os.fspath(checkpoint)
    state = checkpoints.load_file(path)
    model = engine.unwrapped_model
    source = f"checkpoint={path!r}"
    try:
        if isinstance(state, dict) and state.get("shards"):
            state = sharded.load(state, os.path.dirname(os.path.abspath(path)), sharding.mesh_of(model))
            sharding.load_state(model, None, state, full=False)
        elif sharding.is_fsdp(model):
            sharding.load_state(model, None, {"model": checkpoints.extract_state_dict(state, source)}, full=True)
        else:
            torch_tools.load_weights(model, state, strict=True, source=source)
    except (RuntimeError, KeyError) as e:
        raise ValueError(f"{source} does not fit the model {type(model).__name__} (another architecture or "
                         f"number of classes?): {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    if comm.is_main_process():
        logger.info("loaded the weights of %s", path)
    return path


def _find(engine: Any, checkpoint: str) -> str:
    folder = engine.checkpointer.folder()
    if folder is None:
        raise ValueError("checkpoint='auto' looks in the run's checkpoint folder, and this trainer has none: "
                         "set work_dir or add a ModelCheckpoint, or give the checkpoint's path")
    found = folder.find_resumable()
    if found is None:
        raise FileNotFoundError(f"checkpoint='auto': {folder.folder} holds no checkpoint (last.pth, last.prev.pth): "
                                f"train first, or give a weights file's path")
    return found[0]
