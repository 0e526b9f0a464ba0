"""EngineTrainer: the engine plus the ``build_*`` hooks a user fills in."""
import contextlib
import logging
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from basetrainer.callbacks.callbacks import CallbackList
from basetrainer.callbacks.progress_bar import ProgressBar
from basetrainer.dataloader import loader as data
from basetrainer.engine import inference, resume
from basetrainer.engine.engine import Engine
from basetrainer.models import sync_batchnorm
from basetrainer.runtime import comm, fsdp_build, sharding
from basetrainer.runtime.errors import ConfigError
from basetrainer.runtime.modules import ModelWithLoss
from basetrainer.utils import setup_config, torch_tools

logger = logging.getLogger(__name__)

_HOOKS = ("build_train_loader", "build_test_loader", "build_model", "build_criterion",
          "build_optimizer", "build_callbacks")
_warned_no_cuda = False


class EngineTrainer(Engine):
    """Subclass this, implement the six ``build_*`` hooks, call ``self.build(cfg)`` in
    ``__init__`` and ``run()``.

    ``__init__`` fills the config's missing engine keys with their defaults (``self.cfg``; a
    plain dict or an argparse Namespace is filled in place too, and ``self.cfg`` is a Config of
    it, which ``build(cfg)`` uses in its place), checks them, seeds
    every generator with ``cfg.seed``, works out the process's rank, world size and device, and
    refuses a new run in a ``work_dir`` that holds another run's checkpoints (``resume: auto``
    continues it; ``overwrite: true`` moves it aside), before the script writes anything there.

    Example::

        class ClassificationTrainer(EngineTrainer):
            def __init__(self, cfg):
                super().__init__(cfg)
                self.build(cfg)
            def build_train_loader(self, cfg, **kwargs):
                dataset = ImageFolder(cfg.train_data, transform)
                cfg.num_classes = len(dataset.classes)
                return self.build_dataloader(dataset, cfg.batch_size, cfg.num_workers, phase="train")
            def build_test_loader(self, cfg, **kwargs): ...
            def build_model(self, cfg, **kwargs):
                model = build_models.get_models(cfg.net_type, cfg.input_size, cfg.num_classes)
                return self.build_model_parallel(model, cfg.gpu_id, distributed=cfg.distributed)
            def build_criterion(self, cfg, **kwargs): return get_criterion(cfg.loss_type, cfg.num_classes)
            def build_optimizer(self, cfg, **kwargs): return get_optimizer(self.model, cfg.optim_type, cfg.lr)
            def build_callbacks(self, cfg, **kwargs): return [LossesRecorder(), ...]

        history = ClassificationTrainer(cfg).run()
    """

    def __init__(self, cfg: Any) -> None:
        self._given_cfg = cfg  # a dict or Namespace given here means self.cfg when passed to build()
        cfg = setup_config.with_defaults(cfg)
        setup_config.validate(cfg)
        super().__init__(cfg)
        self.seed = cfg.seed
        torch_tools.set_env_random_seed(cfg.seed)
        self.num_epochs = cfg.num_epochs
        self.progress = bool(cfg.progress)
        self.log_freq = cfg.log_freq
        self.amp = str(cfg.amp).lower()
        self.accumulate_steps = cfg.accumulate_steps
        if cfg.loss_reduction not in ("mean", "sum"):
            raise ConfigError(f"config key 'loss_reduction' = {cfg.loss_reduction!r} must be 'mean' (run_step returns "
                             f"the mean loss over its batch, the default) or 'sum' (the sum over its samples)")
        self.loss_reduction = cfg.loss_reduction
        self.clip_grad_norm = cfg.clip_grad_norm or None
        self.data_wait_warn = float(cfg.data_wait_warn)
        self.channels_last = bool(cfg.channels_last)
        self.stall_timeout = float(cfg.stall_timeout)   # validated: seconds, 0 = off
        self.stall_folder = os.path.join(str(cfg.work_dir or ""), "log")
        self._compile_checked = not cfg.compile
        self._model_build: Optional[fsdp_build.BuildAttempt] = None   # while build_model runs (fsdp: for shard)
        self.num_steps = 0      # train batches per epoch (len(train_loader)), not optimizer steps
        self.num_samples = 0    # training samples (the whole data set, all processes)
        self.is_main_process = comm.is_main_process()
        self.world_size = comm.get_world_size()
        self.rank = comm.get_rank()
        self.local_rank = comm.get_local_rank()
        self.gpu_id = list(cfg.gpu_id or [])
        self.device = self._select_device(self.gpu_id, bool(cfg.distributed))
        self.strategy = sharding.strategy_of(cfg)
        self.evaluating = False  # True during evaluate() (EvalReport reports then)
        self._undo: List[Callable[[], None]] = []   # what the evaluation in progress undoes at its end
        self.evaluating_checkpoint: Optional[str] = None   # evaluate(checkpoint=): the file whose weights are tested
        sharding.check_config(cfg, self.device, self.amp)
        resume.claim_work_dir(cfg)

    def _select_device(self, gpu_id: List[int], distributed: bool) -> torch.device:
        global _warned_no_cuda
        if distributed and not comm.is_dist():
            logger.warning("distributed=True but no process group is initialised: training in one "
                           "process. Start the script through launch() or torchrun for DDP.")
        if gpu_id and not torch.cuda.is_available():
            if not _warned_no_cuda and comm.is_main_process():
                logger.warning("gpu_id=%s but this machine has no CUDA device: training on the CPU", gpu_id)
            _warned_no_cuda = True
            return torch.device("cpu")
        if gpu_id:
            count = torch.cuda.device_count()
            absent = [g for g in gpu_id if g < 0 or g >= count]
            if absent:
                raise ConfigError(f"gpu_id={gpu_id}: {absent} not present; this machine has {count} CUDA "
                                 f"device(s) (ids 0..{count - 1}). Set gpu_id to ids that exist, or [] for the CPU")
        device = comm.get_device(gpu_id)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return device

    # ----------------------------------------------------------------------------- build
    def build(self, cfg: Any, **kwargs: Any) -> None:
        """Call the hooks in this order: ``build_train_loader`` -> ``build_test_loader`` ->
        ``build_model`` -> ``build_criterion`` -> ``build_optimizer`` -> ``build_callbacks``.

        The loaders come first so they can set ``cfg.num_classes``/``cfg.classes``; callbacks come
        last so they can use ``self.model``, ``self.optimizer`` and ``self.num_steps``.

        ``cfg`` is usually the object given to ``__init__``; if that was a plain dict or an
        argparse Namespace, the hooks get ``self.cfg`` instead (the Config made of it, with the
        defaults filled in), so ``cfg.key`` and ``cfg.get(key)`` work in every hook.
        """
        if cfg is self._given_cfg:
            cfg = self.cfg
        self.train_loader = self.build_train_loader(cfg, **kwargs)
        self.test_loader = self.build_test_loader(cfg, **kwargs)
        if self.train_loader is not None:
            self.num_steps = len(self.train_loader)
            dataset = getattr(self.train_loader, "dataset", None)
            self.num_samples = len(dataset) if dataset is not None else self.num_steps * cfg.batch_size
            data.check_equal_lengths(self.train_loader)
        # fsdp: ranks but 0 build on the meta device where the model allows (fsdp_meta_init)
        self._model_build = fsdp_build.BuildAttempt()   # build_model_parallel hands it to shard()
        try:
            self.model = fsdp_build.construct(self.cfg, lambda: self.build_model(cfg, **kwargs), self._model_build)
        finally:
            self._model_build = None
        self.criterion = self.build_criterion(cfg, **kwargs)
        self.optimizer = self.build_optimizer(cfg, **kwargs)
        if self.model is None:
            raise ValueError(f"{type(self).__name__}.build_model returned None; return the model")
        if cfg.get("loss_in_replica") and isinstance(self.model, nn.DataParallel):
            self.model = nn.DataParallel(ModelWithLoss(self.model.module, self.criterion),
                                         device_ids=self.model.device_ids)
            self.loss_in_replica = True
        self.callbacks = [c for c in (self.build_callbacks(cfg, **kwargs) or []) if c is not None]

    def _missing(self, hook: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__} must implement {hook}(self, cfg, **kwargs); "
                                   f"see EngineTrainer's docstring for an example")

    def build_train_loader(self, cfg: Any, **kwargs: Any) -> Optional[DataLoader]:
        """Return the training DataLoader (use :meth:`build_dataloader`); may set cfg.num_classes."""
        raise self._missing("build_train_loader")

    def build_test_loader(self, cfg: Any, **kwargs: Any) -> Optional[DataLoader]:
        """Return the evaluation DataLoader, or None for no test phase."""
        raise self._missing("build_test_loader")

    def build_model(self, cfg: Any, **kwargs: Any) -> nn.Module:
        """Return the model, wrapped by :meth:`build_model_parallel`."""
        raise self._missing("build_model")

    def build_criterion(self, cfg: Any, **kwargs: Any) -> nn.Module:
        """Return the loss function."""
        raise self._missing("build_criterion")

    def build_optimizer(self, cfg: Any, **kwargs: Any) -> torch.optim.Optimizer:
        """Return the optimizer of ``self.model``."""
        raise self._missing("build_optimizer")

    def build_callbacks(self, cfg: Any, **kwargs: Any) -> List[Any]:
        """Return the list of callbacks (recorders, LogHistory, ModelCheckpoint, LR schedule...)."""
        raise self._missing("build_callbacks")

    # ----------------------------------------------------------------------------- helpers
    def build_dataloader(self, dataset: Dataset, batch_size: int, num_workers: int = 0, phase: str = "train",
                         shuffle: bool = True, pin_memory: Optional[bool] = None, drop_last: bool = False,
                         distributed: Optional[bool] = None, seed_per_sample: Optional[bool] = None,
                         **kwargs: Any) -> DataLoader:
        """A DataLoader whose order depends only on (seed, epoch), in every mode.

        Args:
            dataset: the data set.
            batch_size: the *global* batch: every step, each of the ``world_size`` processes
                loads its share (they differ by at most one sample; with ``phase="test"``, each
                loads ``batch_size // world_size``).
            num_workers: worker processes per training process.
            phase: ``"train"`` (global batches of a (seed, epoch) permutation, each split over
                the ranks, every sample once per epoch, no padding) or ``"test"`` (each rank a
                disjoint shard, no padding or duplicates).
            shuffle: shuffle the training order (per epoch, from the seed).
            pin_memory: pin host memory, so that batches are copied to the GPU asynchronously
                (``non_blocking``); default (None): when training on CUDA. Never on the CPU.
            drop_last: drop the last incomplete global batch (in every mode).
            distributed: shard over the processes (default: whenever a process group exists).
            seed_per_sample: load each train sample with python's, numpy's and torch's random
                generators seeded from (seed, epoch, index), so random augmentation is the same
                whatever worker, batch or resumed run loads it (default: the config's
                ``seed_per_sample``, true; see :mod:`basetrainer.dataloader.seeding`).
            **kwargs: passed to :class:`torch.utils.data.DataLoader` (e.g. ``collate_fn``);
                ``balance`` (default: the config's ``balance``, train phase) and ``labels`` (the
                class of every sample, when the data set has no ``.targets``): see
                :mod:`basetrainer.dataloader.data_resample`.
        """
        if seed_per_sample is None:
            seed_per_sample = bool(self.cfg.get("seed_per_sample", True))
        if phase == "train":   # class-balanced resampling (the config's balance key; labels= may be given)
            kwargs.setdefault("balance", self.cfg.get("balance"))
        if num_workers and self.stall_timeout > 0:   # a worker names the samples it loads when the rank stalls
            kwargs.setdefault("stall_watch", (self.stall_timeout, self.stall_folder, comm.get_rank()))
        return data.build_dataloader(dataset, batch_size, num_workers, phase=phase, shuffle=shuffle,
                                     pin_memory=pin_memory is not False and self.device.type == "cuda",
                                     drop_last=drop_last, distributed=distributed, seed=self.seed,
                                     seed_per_sample=seed_per_sample, **kwargs)

    def build_model_parallel(self, model: nn.Module, gpu_id: Optional[Sequence[int]] = None,
                             distributed: Optional[bool] = None, **kwargs: Any) -> nn.Module:
        """Move ``model`` to the device and wrap it for the mode.

        DDP when a process group exists (``device_ids`` on GPU, none on CPU; ``sync_bn`` and
        ``find_unused_parameters`` from the config or keywords), DataParallel for several GPUs
        in one process, else the bare model on ``self.device``. With ``strategy: fsdp``
        (``sync_bn`` too): the blocks and the root sharded by FSDP2 (:func:`basetrainer.runtime.fsdp_build.shard`; the
        blocks: ``wrap_policy``, else ``fsdp_wrap``, else the model's repeated blocks).
        """
        gpu_id = list(kwargs.pop("device_ids", None) or (self.gpu_id if gpu_id is None else gpu_id) or [])
        sync_bn = kwargs.pop("sync_bn", self.cfg.get("sync_bn", False))
        if self.strategy == "fsdp":   # a process group exists (checked at __init__); ranks > 0 built on meta
            if self.channels_last:
                model = model.to(memory_format=torch.channels_last)
            if sync_bn and comm.get_world_size() > 1:
                model = self._sync_batchnorm(model)
            return fsdp_build.shard(model, self.device, self.cfg, policy=self.wrap_policy, attempt=self._model_build)
        find_unused = kwargs.pop("find_unused_parameters", self.cfg.get("find_unused_parameters", False))
        model = model.to(self.device)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if self.cfg.get("compile"):
            try:
                model = torch.compile(model)
            except Exception as e:  # compile errors mostly surface at the first step (engine)
                raise RuntimeError(f"torch.compile failed ({type(e).__name__}: {e}); set compile: false "
                                   f"to train without it") from e
        if comm.is_dist() and comm.get_world_size() > 1 and distributed is not False:
            if sync_bn:
                model = self._sync_batchnorm(model)
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            return nn.parallel.DistributedDataParallel(model, device_ids=device_ids,
                                                       find_unused_parameters=find_unused, **kwargs)
        if self.device.type == "cuda" and len(gpu_id) > 1:
            return nn.DataParallel(model, device_ids=gpu_id)
        return model

    def _sync_batchnorm(self, model: nn.Module) -> nn.Module:
        """``sync_bn``: BatchNorm over the global batch (torch's SyncBatchNorm needs CUDA;
        GlobalBatchNorm also runs on gloo/CPU)."""
        if self.device.type == "cuda":
            return nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return sync_batchnorm.convert_sync_batchnorm(model)

    #: ``strategy: fsdp``: set to a function ``module -> bool`` (or define a method) to choose the
    #: modules sharded one by one (the outermost accepted ones); None: ``fsdp_wrap`` or the defaults.
    wrap_policy: Optional[Callable[[nn.Module], bool]] = None

    # ----------------------------------------------------------------------------- run
    def extra_callbacks(self) -> List[Any]:
        """The progress bars (``progress``, main process only, unless the list has its own), and in a
        search trial (the config's ``tune``, see :mod:`basetrainer.tune`) the callback that reports to it."""
        extra: List[Any] = []
        if self.progress and comm.is_main_process() and not any(isinstance(c, ProgressBar) for c in self.callbacks):
            extra.append(ProgressBar())
        if self.cfg.get("tune"):
            from basetrainer.callbacks.tune_report import TuneReport

            extra.append(TuneReport(self.cfg.tune))
        return extra

    def restore(self) -> None:
        """Apply the run-folder rules and ``cfg.resume`` ("" = a new run, "auto" = continue this
        run's newest loadable checkpoint, or a checkpoint path); see :mod:`basetrainer.engine.resume`."""
        resume.prepare_run(self)

    # ----------------------------------------------------------------------------- evaluate, predict
    @contextlib.contextmanager
    def evaluation(self, loader: Any, checkpoint: Optional[str] = None, what: str = "evaluate()") -> Iterator[None]:
        """The ``with`` body evaluates (or predicts): ``checkpoint``'s weights are loaded (see
        :func:`~basetrainer.engine.inference.load_checkpoint`), ``loader`` is the test loader, the
        callbacks are bound, ``evaluating`` is True and ``evaluating_checkpoint`` names the file
        whose weights are tested (ModelEMA swaps no average in over them). On leaving, also when
        the body raises, what callbacks asked to undo (:meth:`at_evaluation_end`: ModelEMA's
        swap) is undone, these fields and the model's train/eval mode are as they were, and
        inside ``run()`` (from a callback) the weights a ``checkpoint`` replaced are put back.

        Raises:
            RuntimeError: inside another evaluation, or inside the test phase of ``run()`` (from a
                callback's ``on_test_*``): its callbacks' test figures, a report and a swapped-in
                average would be the inner call's. Before anything is loaded.
        """
        if self.evaluating or self.checkpointer.in_test_phase:
            where = "evaluate() or predict()" if self.evaluating else "run()'s test phase (on_test_begin to on_test_end)"
            raise RuntimeError(f"{type(self).__name__}.{what} was called inside {where}: its test events would overwrite "
                               f"the outer test phase's figures and swap weights under it; call it from on_epoch_end, "
                               f"or after run()")
        live = None
        if checkpoint and self.checkpointer.running:   # the weights being trained: back after the call
            live = {k: v.detach().clone() for k, v in self.unwrapped_model.state_dict().items()}
        loaded = inference.load_checkpoint(self, checkpoint) if checkpoint else None
        saved = (self.test_loader, self._callbacks, self.evaluating, self.evaluating_checkpoint, self.model.training)
        self.test_loader, self.evaluating, self.evaluating_checkpoint = loader, True, loaded
        self._callbacks = CallbackList(list(self.callbacks or []) + self.extra_callbacks(), self)
        self._undo = []
        try:
            yield
        finally:
            try:
                for undo in reversed(self._undo):
                    undo()
                if live is not None:
                    self.unwrapped_model.load_state_dict(live)
            finally:
                self.test_loader, self._callbacks, self.evaluating, self.evaluating_checkpoint, training = saved
                self.model.train(training)

    def at_evaluation_end(self, undo: Callable[[], None]) -> None:
        """Call ``undo`` when the evaluate() or predict() in progress ends, also when it raises
        (ModelEMA puts the live weights back this way when a test phase fails)."""
        self._undo.append(undo)

    def evaluate(self, loader: Any = None, checkpoint: Optional[str] = None,
                 batch_size: Optional[int] = None) -> Dict[str, Any]:
        """Run the test phase with this trainer's callbacks (no training) and return the test
        figures its recorders wrote, reduced over every rank: ``{"test/Accuracy": ..., "test/loss": ...}``.

        Args:
            loader: a data set (a test loader is built: every process a shard), or a DataLoader
                that counts each sample once over the processes: any in one process, one of
                ``build_dataloader(..., phase="test")`` (or a DistributedSampler that does not
                pad) in several (default: the test loader of ``build_test_loader``).
            checkpoint: load these weights first: a weights file (best or per-epoch), a resumable
                ``last.pth``, or ``"auto"`` (the newest loadable checkpoint of this run's folder).
            batch_size: the global batch for a data set (default: ``cfg.batch_size``); an error
                with a DataLoader or with no loader (they have their own).

        Raises:
            ValueError: no test data (no ``build_test_loader`` loader and none given), a loader
                not sharded for the processes (a plain DataLoader in a multi-process run), a
                padding DistributedSampler, a checkpoint that does not fit the model.
            FileNotFoundError: the checkpoint does not exist.

        Example::

            figures = trainer.evaluate(checkpoint="work_space/model/last.pth")
        """
        return inference.evaluate(self, loader, checkpoint, batch_size)

    def predict(self, loader: Any, output: Optional[str] = None, checkpoint: Optional[str] = None,
                transform: Optional[Callable] = None, batch_size: Optional[int] = None) -> Any:
        """The outputs of :meth:`predict_step` for every sample, in dataset order, gathered from
        every rank (no padding duplicate, no sample missing).

        Args:
            loader: a DataLoader that visits its data set in order (``build_dataloader(...,
                phase="test")``, or a plain sequential one in one process), a data set, or a
                folder of images (or one image; read with ``transform``, sorted by path).
            output: a ``.npz``, ``.npy`` (one output) or ``.csv`` file: the outputs are streamed to it in
                bounded memory (the main process writes; a folder's files are its ``id``s) and
                its path is returned. None: the outputs are returned (on every rank).
            checkpoint: load these weights first (see :meth:`evaluate`).
            transform: for a folder (default: the test data set's ``transform``).
            batch_size: the global batch for a data set or folder (default: ``cfg.batch_size``);
                an error with a DataLoader (it has its own).

        Returns:
            The outputs in the structure ``predict_step`` gives (CPU tensors, one row per
            sample), or the output file's path.

        Raises:
            ValueError: an output suffix other than .npz/.npy/.csv, a shuffled/padded/drop_last
                loader, a file in the folder that is not an image, a checkpoint that does not fit.
        """
        return inference.predict(self, loader, output, checkpoint, transform, batch_size)

    def predict_step(self, batch: Any) -> Any:
        """One forward of :meth:`predict` (under no_grad, eval mode, autocast as in training):
        ``self.model`` on the batch's inputs (a tensor, or the first entry of ``(inputs, ...)``).
        Override to return other outputs (e.g. probabilities): tensors, or tuples/dicts of them."""
        return inference.predict_step(self, batch)
