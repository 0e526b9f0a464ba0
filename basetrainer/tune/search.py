"""The search driver: an Optuna study in SQLite under ``work_dir``, one ordinary run of the user's
script per trial (``work_dir/trials/<n>/``), resumable after a kill."""
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from basetrainer.tune import report, space
from basetrainer.tune.space import SearchError
from basetrainer.utils import setup_config

logger = logging.getLogger(__name__)

#: the driver's own options (each takes one value); every other argument goes to the script
OPTIONS = {"--space": "space", "--trials": "trials", "--timeout": "timeout", "--objective": "objective",
           "--direction": "direction"}
FINISHED = ("COMPLETE", "PRUNED", "FAIL")


def require_optuna() -> None:
    """Optuna is the ``tune`` extra: without it the search is one error naming its pip command."""
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise SearchError('the search needs Optuna, which is not installed: pip install "basetrainer[tune]"') from None


def write_errors() -> Tuple[type, ...]:
    """The errors of a work_dir that cannot be written (a full disk): the OS's, and SQLAlchemy's for
    the study's SQLite file (SQLAlchemy comes with Optuna, so it is imported only here)."""
    from sqlalchemy.exc import OperationalError

    return OSError, OperationalError


def split_args(argv: Sequence[str]) -> Tuple[str, Dict[str, str], List[str]]:
    """``SCRIPT [--space F] [--trials N] ... [script args]`` -> (script, driver options, script args).
    The driver's options are read before a ``--``; what follows ``--`` all goes to the script."""
    script, options, rest = "", {}, []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest += args[i + 1:]
            break
        name, _, inline = arg.partition("=")
        if name in OPTIONS:
            if inline:
                options[OPTIONS[name]] = inline
            elif i + 1 < len(args):
                options[OPTIONS[name]] = args[i + 1]
                i += 1
            else:
                raise SearchError(f"{name} needs a value")
        elif not script and not arg.startswith("-"):
            script = arg
        else:
            rest.append(arg)
        i += 1
    if not script or not os.path.isfile(script):
        raise SearchError(f"SCRIPT = {script!r} is not a file; usage: python -m basetrainer.tune SCRIPT --space "
                          f"search.yaml [--trials N] [--timeout S] [script args...]")
    if "space" not in options:
        raise SearchError("--space is missing: give the search file (e.g. --space configs/search.yaml)")
    return script, options, rest


def flag_value(args: Sequence[str], *names: str) -> Optional[str]:
    for i, arg in enumerate(args):
        name, _, inline = arg.partition("=")
        if name in names:
            return inline or (args[i + 1] if i + 1 < len(args) else None)
    return None


def script_keys(script: str, script_args: Sequence[str]) -> Tuple[List[str], Dict[str, Any]]:
    """The config keys the script takes (engine keys, its ``--help`` flags, its config file's keys)
    and the values of its config file (for type checks)."""
    known = set(setup_config.ENGINE_KEYS)
    out = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, setup_config.TRIAL_ENV: ""})
    known |= {m.replace("-", "_") for m in re.findall(r"--([A-Za-z][A-Za-z0-9_-]*)", out.stdout)}
    typed: Dict[str, Any] = {}
    config_file = flag_value(script_args, "-c", "--config_file")
    if config_file:
        try:
            typed = dict(setup_config.load_config(config_file))
        except (FileNotFoundError, ValueError) as e:
            raise SearchError(f"the script's -c: {e}") from None
        known |= set(typed)
    return sorted(known), typed


class Search:
    """One search: the settings (see :mod:`basetrainer.tune.space`), the script and its arguments."""

    def __init__(self, script: str, script_args: Sequence[str], settings: Dict[str, Any], work_dir: str) -> None:
        self.script = script
        self.script_args = list(script_args)
        self.settings = settings
        self.work_dir = os.path.abspath(work_dir)
        self.url = f"sqlite:///{os.path.join(self.work_dir, 'study.db')}"
        self.direction = settings["direction"] or ("minimize" if re.search(r"loss|err|mse|mae", settings["objective"],
                                                                           re.I) else "maximize")

    def open_study(self) -> Any:
        """Create the study, or continue it when its space, objective and direction are unchanged."""
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        os.makedirs(self.work_dir, exist_ok=True)
        self.storage = optuna.storages.RDBStorage(self.url)
        wanted = space.signature(self.settings)
        names = [s.study_name for s in optuna.get_all_study_summaries(self.storage)]
        if self.settings["study_name"] in names:
            old = optuna.load_study(study_name=self.settings["study_name"], storage=self.storage)
            diff = space.differences(old.user_attrs.get("signature", {}), wanted)
            if diff:
                raise SearchError(f"the study in {self.work_dir} was made with another search: "
                                  + "; ".join(diff) + ". Use the original search file, or another work_dir "
                                  f"(or study_name) for the new search")
        # a continued search draws on from seed + its trials so far, not the first search's draws again
        done = len(old.trials) if self.settings["study_name"] in names else 0
        study = optuna.create_study(study_name=self.settings["study_name"], storage=self.storage,
                                    sampler=optuna.samplers.TPESampler(seed=self.settings["seed"] + done),
                                    pruner=space.pruner_of(self.settings["pruner"]), direction=self.direction,
                                    load_if_exists=True)
        study.set_user_attr("signature", wanted)
        return study

    def begun(self) -> bool:
        """Whether this work_dir holds the study with a trial already."""
        if not os.path.isfile(os.path.join(self.work_dir, "study.db")):
            return False
        import optuna

        summaries = optuna.get_all_study_summaries(optuna.storages.RDBStorage(self.url))
        return any(s.study_name == self.settings["study_name"] and s.n_trials for s in summaries)

    def recover(self, study: Any) -> List[int]:
        """Trials left RUNNING by a killed search: marked failed (``interrupted``) and queued again
        with the same parameters. Returns their numbers."""
        import optuna

        study_id = self.storage.get_study_id_from_name(self.settings["study_name"])
        lost = []
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            trial_id = self.storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
            self.storage.set_trial_user_attr(trial_id, "interrupted", True)
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number}, skip_if_exists=False)
            lost.append(t.number)
        return lost

    def finished(self, study: Any) -> int:
        return sum(1 for t in study.get_trials(deepcopy=False)
                   if t.state.name in FINISHED and not t.user_attrs.get("interrupted"))

    def run(self) -> Any:
        os.makedirs(self.work_dir, exist_ok=True)
        lock = open(os.path.join(self.work_dir, "search.lock"), "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SearchError(f"another search runs in work_dir {self.work_dir} (search.lock is held); wait for it "
                              f"or use another work_dir") from None
        if not self.begun():   # a continued search had its objective checked when it began
            self.check_objective()
        study = self.open_study()
        lost = self.recover(study)
        if lost:
            logger.info(f"search: trial(s) {lost} were interrupted; retrying them with the same parameters")
        start = time.monotonic()
        timeout = float(self.settings["timeout"] or 0)
        while self.finished(study) < self.settings["trials"]:
            if timeout and time.monotonic() - start > timeout:
                logger.info(f"search: time budget of {timeout:g} s spent")
                break
            self.run_trial(study)
            report.write_tables(study, self.work_dir, self.settings)
        report.write_all(study, self.work_dir, self.settings)
        lock.close()
        return study

    def check_objective(self) -> None:
        """Launch the script once in check mode (not a trial: nothing enters the study): its
        TuneReport writes the figures the recorders declare and the run ends before its first
        step. An objective that is not among them, when every recorder declares its figures, is
        an error before any trial runs; otherwise the first trial's first epoch tells."""
        folder = os.path.join(self.work_dir, "check")
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        found_file = os.path.join(folder, "figures.json")
        tune = {"check": found_file, "objective": self.settings["objective"], "direction": self.direction,
                "params": []}
        overlay = setup_config.save_config({"work_dir": folder, "tune": tune}, os.path.join(folder, "trial.yaml"))
        with open(os.path.join(folder, "output.log"), "w") as out:
            rc = subprocess.run([sys.executable, self.script, *self.script_args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, setup_config.TRIAL_ENV: overlay}).returncode
        if not os.path.isfile(found_file):
            error = _last_error(os.path.join(folder, "output.log")) or f"exit status {rc}"
            logger.warning(f"search: the check launch of {self.script} gave no figures ({error}); the objective is checked "
                  f"at the first trial's first epoch")
            return
        with open(found_file, encoding="utf-8") as f:
            found = json.load(f)
        shutil.rmtree(folder, ignore_errors=True)
        if found.get("error"):
            raise SearchError(found["error"])
        key, figures = found["objective"], found["figures"]
        if key in figures or key == "lr":
            return
        if found["undeclared"]:
            logger.warning(f"search: objective {key!r} is not among the declared figures {figures}; "
                  f"{', '.join(found['undeclared'])} declare(s) none (Recorder.figures), so the first trial's "
                  f"first epoch tells")
            return
        raise SearchError(f"objective {key!r} is not a figure of this run (its recorders write {figures}); "
                          f"set objective in the search file, or --objective, to one of them")

    def run_trial(self, study: Any) -> None:
        import optuna

        trial = study.ask()
        values = space.suggest(trial, self.settings["params"])
        folder = os.path.join(self.work_dir, "trials", f"{trial.number:03d}")
        os.makedirs(folder, exist_ok=True)
        result_file = os.path.join(folder, "result.json")
        overrides = {**values, "work_dir": folder,
                     "tune": {"storage": self.url, "study": self.settings["study_name"], "trial": trial.number,
                              "objective": self.settings["objective"], "direction": self.direction,
                              "pruner": self.settings["pruner"],
                              "params": sorted(values), "result": result_file}}
        overlay = setup_config.save_config(overrides, os.path.join(folder, "trial.yaml"))
        trial.set_user_attr("folder", os.path.relpath(folder, self.work_dir))
        logger.info(f"search: trial {trial.number} {json.dumps(values, default=str)}")
        began = time.monotonic()
        with open(os.path.join(folder, "output.log"), "w") as out:
            rc = subprocess.run([sys.executable, self.script, *self.script_args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, setup_config.TRIAL_ENV: overlay}).returncode
        seconds = time.monotonic() - began
        result = {}
        if os.path.isfile(result_file):
            with open(result_file, encoding="utf-8") as f:
                result = json.load(f)
        trial.set_user_attr("seconds", round(seconds, 1))
        trial.set_user_attr("epochs", len(result.get("values") or []))
        state = result.get("state")
        if result.get("kind") == "objective":
            trial.set_user_attr("error", result["error"])
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise SearchError(result["error"])
        if rc == 0 and state == "complete" and result.get("value") is not None:
            study.tell(trial, result["value"])
        elif rc == 0 and state == "pruned":
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            ended = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
            error = _last_error(os.path.join(folder, "output.log")) or f"{ended}, state {state}"
            trial.set_user_attr("error", error)
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        done = study.get_trials(deepcopy=False)[trial.number]
        shown = f"{done.value:.4f}" if done.value is not None else done.user_attrs.get("error", "")
        logger.info(f"search: trial {trial.number} {done.state.name.lower()} {shown} ({seconds:.0f} s)")


def _last_error(log_file: str) -> str:
    """The last line of a failed trial's output that names an error (else its last line)."""
    with open(log_file, encoding="utf-8", errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line):
            return line[:500]
    return lines[-1][:500] if lines else ""
