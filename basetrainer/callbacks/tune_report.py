"""TuneReport: a search trial's figure, each epoch, to Optuna (and its pruner) or to NNI.

The trainer adds it by itself when the config holds ``tune`` (set by ``python -m basetrainer.tune``
for each trial, or ``"nni"`` when the script runs as an NNI trial), so the user's script is not
changed. Every rank runs it: it checks that all ranks train with the same parameters, rank 0
reports and asks the pruner, and the decision is broadcast, so every rank stops in the same epoch.
"""
import json
import logging
import math
import os
from typing import Any, Dict, List, Optional, Union

from basetrainer.callbacks.callbacks import Callback, infer_mode, resolve_indicator
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.callbacks.recorder import PHASES, Recorder
from basetrainer.runtime import atomic, comm

logger = logging.getLogger(__name__)


class TuneReport(Callback):
    """Report a trial's objective figure at every ``on_epoch_end``; stop the trial when pruned.

    Args:
        context: the config's ``tune`` value: ``"nni"`` (report to NNI), or the mapping a search
            writes: ``storage`` (the study's SQLAlchemy URL), ``study``, ``trial`` (its number),
            ``pruner`` (the search file's setting), ``objective`` (a figure name; "" = the ModelCheckpoint's indicator), ``direction``
            (``maximize``/``minimize``), ``params`` (the searched keys) and ``result`` (the JSON
            file rank 0 writes: state, value, epochs, the parameters and last epoch of every rank);
            with ``check`` (a JSON file) the run is the search's check launch: rank 0 writes the
            objective's logs key and the figures the recorders declare there, and the run ends
            before its first step.
    """

    def __init__(self, context: Union[str, Dict[str, Any]]) -> None:
        super().__init__()
        self.nni = context == "nni"
        self.context: Dict[str, Any] = {} if self.nni else dict(context)
        self.key = ""
        self.values: List[float] = []
        self.pruned_epoch: Optional[int] = None
        self.last_epoch: Optional[int] = None
        self.params_by_rank: List[Dict[str, Any]] = []
        self._trial: Any = None
        self.error: Dict[str, str] = {}   # a search error found in this run (kept in the result file)

    # ------------------------------------------------------------------ begin
    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        cfg = self.trainer.cfg
        keys = sorted(self.context.get("params") or [])
        mine = {k: cfg.get(k) for k in keys}
        self.params_by_rank = comm.all_gather_object(mine)
        differ = [r for r, p in enumerate(self.params_by_rank) if p != self.params_by_rank[0]]
        if differ:
            raise RuntimeError(f"search trial: rank(s) {differ} train with other parameters than rank 0 "
                               f"({self.params_by_rank[differ[0]]} vs {self.params_by_rank[0]}); every rank must "
                               f"read the same trial (start the ranks from one launch() or torchrun command)")
        if self.context.get("check"):
            self._check()
            return
        self.key, direction = self._objective()
        self.maximize = direction == "maximize"
        if self.is_main_process and not self.nni:
            self._trial = _open_trial(self.context)
            self._write("running")

    def _check(self) -> None:
        """The search's check launch (``check``: a JSON file): write the objective's logs key and the
        figures the recorders declare, and end the run before its first step."""
        found: Dict[str, Any] = {"figures": [], "undeclared": []}
        try:
            found["objective"] = self._objective()[0]
        except ValueError as e:
            found["error"] = str(e)
        for cb in self.trainer.callbacks or []:
            if isinstance(cb, Recorder):
                names = cb.figures()
                if names is None:
                    found["undeclared"].append(type(cb).__name__)
                    continue
                found["figures"] += [f"{phase}/{name}" for phase in PHASES if cb.records(phase) for name in names]
        if self.is_main_process:
            atomic.write_atomically(json.dumps(found, indent=1), self.context["check"])
        self.trainer.stop_training = True

    def _objective(self) -> tuple:
        """The logs key of the figure and its direction ("" objective: the checkpoint's indicator)."""
        name = self.context.get("objective") or ""
        direction = self.context.get("direction") or ""
        if not name:
            ckpt = next((c for c in self.trainer.callbacks or [] if isinstance(c, ModelCheckpoint)), None)
            if ckpt is None or not ckpt.indicator:
                raise ValueError("search: objective is not set and the script has no ModelCheckpoint with an "
                                 "indicator; set objective in the search file (e.g. objective: test/Accuracy)")
            name = ckpt.indicator
            mode = ckpt.mode or infer_mode(name)
            wanted = "maximize" if mode == "max" else "minimize"
            if direction and direction != wanted:
                raise ValueError(f"search: the objective defaults to the checkpoint's indicator {name!r}, which is "
                                 f"{'maximised' if mode == 'max' else 'minimised'}, but the study's direction is "
                                 f"{direction!r}; set objective and direction in the search file")
            direction = wanted
        return resolve_indicator(name, self.trainer), direction or ("maximize" if infer_mode(name) == "max"
                                                                    else "minimize")

    # ------------------------------------------------------------------ each epoch
    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        # a script whose recorders do not declare their figures (Recorder.figures) is checked here
        logs = logs if logs is not None else {}
        if self.key not in logs or logs[self.key] is None:
            figures = sorted(k for k, v in logs.items() if isinstance(v, (int, float)))
            message = (f"search: objective {self.key!r} is not a figure of this run (its figures: {figures}); "
                       f"set objective in the search file to one of them")
            self.error = {"error": message, "kind": "objective"}
            raise KeyError(message)
        value = float(logs[self.key])   # once per epoch, not per step
        self.values.append(value)
        self.last_epoch = epoch
        prune = False
        if self.is_main_process:
            if self.nni:
                import nni

                nni.report_intermediate_result(value)
            elif math.isfinite(value):
                self._trial.report(value, epoch)
                # after the last epoch a stop saves nothing: the trial is complete, whatever the pruner says
                prune = epoch + 1 < self.trainer.num_epochs and self._trial.should_prune()
        if comm.broadcast_object(prune):   # rank 0 decides; every rank stops after this epoch
            self.pruned_epoch = epoch
            self.trainer.stop_training = True
            logger.info("search: trial pruned after epoch %d (%s = %.4f)", epoch, self.key, value)
        if self.is_main_process and not self.nni:
            self._write("running")

    # ------------------------------------------------------------------ end
    def on_train_end(self, logs: Optional[dict] = None) -> None:
        if self.context.get("check"):
            return
        if not self.nni:   # each rank's own account (no collective here: a rank may be failing)
            mine = {"rank": comm.get_rank(), "params": self.params_by_rank[comm.get_rank()] if self.params_by_rank
                    else None, "last_epoch": self.last_epoch, "pruned_epoch": self.pruned_epoch}
            folder = os.path.dirname(os.path.abspath(self.context["result"]))
            atomic.write_atomically(json.dumps(mine, default=str), os.path.join(folder, f"rank{comm.get_rank()}.json"))
        finite = [v for v in self.values if math.isfinite(v)]
        best = (max(finite) if self.maximize else min(finite)) if finite else None
        if not self.is_main_process:
            return
        if self.nni:
            if best is not None:
                import nni

                nni.report_final_result(best)
            return
        done = self.last_epoch is not None and self.last_epoch + 1 >= self.trainer.num_epochs
        state = "pruned" if self.pruned_epoch is not None else ("complete" if done and best is not None else "failed")
        self._write("error" if self.error else state, value=best, config=_plain_config(self.trainer.cfg), **self.error)

    def _write(self, state: str, **extra: Any) -> None:
        result = {"state": state, "objective": self.key, "values": self.values, "pruned_epoch": self.pruned_epoch,
                  "params_by_rank": self.params_by_rank, "world_size": comm.get_world_size(), **extra}
        atomic.write_atomically(json.dumps(result, indent=1, default=str), self.context["result"])


def _open_trial(context: Dict[str, Any]) -> Any:
    """The search's running Optuna trial, opened in this process through the study's storage."""
    import optuna

    storage = optuna.storages.RDBStorage(context["storage"])
    study = optuna.load_study(study_name=context["study"], storage=storage, pruner=pruner_of(context["pruner"]))
    study_id = storage.get_study_id_from_name(context["study"])
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, int(context["trial"]))
    return optuna.trial.Trial(study, trial_id)


def _plain_config(cfg: Any) -> Dict[str, Any]:
    """The run's config without the search's own key (what ``-c best.yaml`` needs)."""
    out = {k: v for k, v in dict(cfg).items() if k != "tune"}
    out.pop("config_file", None)
    return json.loads(json.dumps(out, default=str))


def pruner_of(setting: Any) -> Any:
    """The Optuna pruner a search file names (``median``, ``hyperband``, ``none``; a mapping may add
    its keywords: ``{type: median, n_startup_trials: 2}``). Optuna keeps no pruner in its storage,
    so the search and each trial build it from this same setting."""
    import optuna

    kwargs = dict(setting) if isinstance(setting, dict) else {"type": setting}
    kind = kwargs.pop("type", "median")
    if kind == "median":
        return optuna.pruners.MedianPruner(**kwargs)
    if kind == "hyperband":
        return optuna.pruners.HyperbandPruner(**kwargs)
    return optuna.pruners.NopPruner()
