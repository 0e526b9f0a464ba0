"""What :func:`~basetrainer.engine.inference.evaluate` and
:func:`~basetrainer.engine.inference.predict` run over: a DataLoader checked, or a test loader
built (every rank a shard, no padding) of a data set or of a folder of images."""
import os
from typing import Any, Callable, Optional

from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler

from basetrainer.dataloader import loader as loaders
from basetrainer.runtime import comm


def evaluate_loader(engine: Any, loader: Any, batch_size: Optional[int] = None) -> DataLoader:
    """The loader evaluate runs over: ``loader``, a test loader built of a data set (every rank a
    shard; ``batch_size`` or the config's), or (None) the trainer's test loader; checked to
    count each sample once over the processes (:func:`~basetrainer.dataloader.loader.check_test_shards`)."""
    what = "evaluate(loader)"
    if batch_size is not None and (loader is None or isinstance(loader, DataLoader)):
        raise _own_batch("evaluate", batch_size, "the trainer's test loader" if loader is None else "this DataLoader")
    if loader is None:
        loader, what = engine.test_loader, f"{type(engine).__name__}.evaluate(): the test loader of build_test_loader"
        if loader is None:
            raise ValueError(f"{type(engine).__name__}.evaluate(): there is no test data: return a test loader "
                             f"from build_test_loader (e.g. set test_data in the config), or pass one: "
                             f"evaluate(loader=...)")
    elif not isinstance(loader, DataLoader):
        loader = _loader_of(engine, _as_dataset(loader, "evaluate(loader=...)"), batch_size, "evaluate")
    loaders.check_test_shards(loader, what)
    batches = loader.batch_sampler
    if type(batches) is BatchSampler and batches.drop_last and len(batches.sampler) % batches.batch_size:
        left = len(batches.sampler) % batches.batch_size   # one process: the others are refused drop_last
        raise ValueError(f"{what}: the loader drops its last incomplete batch (drop_last=True), so {left} of its "
                         f"{len(batches.sampler)} samples would not count: build it with drop_last=False, or pass "
                         f"the data set itself")
    return loader


def predict_loader(engine: Any, loader: Any, transform: Optional[Callable],
                    batch_size: Optional[int]) -> tuple:
    """``(loader, the name of sample i as a function of i or None, built here)`` for predict:
    a DataLoader checked (:func:`check_in_order`), or one built of a data set or a folder."""
    if isinstance(loader, (str, os.PathLike)):
        from basetrainer.dataloader.image_files import ImageFiles

        transform = transform if transform is not None else _test_transform(engine)
        if transform is None:
            raise ValueError(f"predict({os.fspath(loader)!r}): the images need the test transform, and the "
                             f"trainer's test loader has none (no test loader, or its data set has no .transform): "
                             f"give predict(folder, transform=...)")
        files = ImageFiles(os.fspath(loader), transform=transform, key="predict")
        return _loader_of(engine, files, batch_size, "predict"), files.relative, True
    if not isinstance(loader, DataLoader):
        return _loader_of(engine, _as_dataset(loader, "predict(loader)"), batch_size, "predict"), None, True
    if batch_size is not None:
        raise _own_batch("predict", batch_size, "this DataLoader")
    check_in_order(loader)
    return loader, None, False


def _own_batch(what: str, batch_size: Any, loader: str) -> ValueError:
    return ValueError(f"{what}(batch_size={batch_size!r}): batch_size={batch_size!r} is the batch of a data set "
                      f"{what}() loads, and {loader} has its own: pass the data set itself (its test loader is "
                      f"built with that batch), or leave batch_size out")


def _as_dataset(value: Any, what: str) -> Dataset:
    if isinstance(value, Dataset) or (hasattr(value, "__getitem__") and hasattr(value, "__len__")):
        return value
    raise TypeError(f"{what}: got a {type(value).__name__}; give a DataLoader, a data set"
                    + (" or a folder of images" if what.startswith("predict") else ""))


def _loader_of(engine: Any, dataset: Dataset, batch_size: Optional[int], what: str) -> DataLoader:
    """A test loader (every rank a shard, no padding) of ``dataset``, with the config's global
    batch size and workers."""
    cfg = engine.cfg if engine.cfg is not None and hasattr(engine.cfg, "get") else {}
    size = cfg.get("batch_size") if batch_size is None else batch_size
    if size is None:
        raise ValueError(f"{what}(): give batch_size= (the global batch) to load a data set")
    return loaders.build_dataloader(dataset, size, int(cfg.get("num_workers") or 0), phase="test",
                                    shuffle=False, pin_memory=engine.device.type == "cuda", seed=engine.seed)


def check_in_order(loader: DataLoader) -> None:
    """predict's loader must visit every sample of its data set once, in order (rank r of W its
    shard r, r + W, ...): a SequentialSampler in one process, or build_dataloader's test shards."""
    world = comm.get_world_size()
    sampler, batches = loader.sampler, loader.batch_sampler
    fix = ("pass the data set itself (predict builds its loader), or build the loader with "
           "build_dataloader(dataset, batch_size, phase='test', shuffle=False)")
    if batches is not None and (type(batches) is not BatchSampler or batches.drop_last):
        why = "drops its last incomplete batch" if getattr(batches, "drop_last", False) else \
            f"batches samples with a {type(batches).__name__}"
        raise ValueError(f"predict(loader): the loader {why}, so samples would be missing or out of order: {fix}")
    if isinstance(sampler, loaders.ShardSampler):
        if sampler.num_replicas == world and sampler.num_samples_total == len(loader.dataset):
            return
    elif isinstance(sampler, SequentialSampler) and world == 1:
        return
    raise ValueError(f"predict(loader): its {type(sampler).__name__} does not give every sample of the data set "
                     f"once, in order, over the {world} process(es) (shuffled, padded, a subset, or not sharded "
                     f"for this world size): {fix}")


def _test_transform(engine: Any) -> Optional[Callable]:
    """The ``transform`` of the trainer's test data set (looking through wrappers)."""
    dataset = getattr(engine.test_loader, "dataset", None)
    for _ in range(8):
        if dataset is None:
            return None
        if getattr(dataset, "transform", None) is not None:
            return dataset.transform
        inner = getattr(dataset, "datasets", None)
        dataset = inner[0] if inner else getattr(dataset, "dataset", None)
    return None
