"""The search file: the space of config keys, the objective, the budget; checked before any trial.

Example (configs/search.yaml)::

    trials: 12                      # finished trials wanted (complete, pruned or failed)
    timeout: 0                      # seconds after which no new trial starts (0: none)
    objective: ""                   # a figure: Accuracy, test/loss, ...; "": the checkpoint's indicator
    direction: ""                   # maximize / minimize; "": from the objective (loss, err -> minimize)
    pruner: median                  # median, hyperband or none
    params:
      lr: {low: 0.005, high: 0.2, log: true}        # float range (log-uniform)
      num_warn_up: {low: 0, high: 2}                # int range (both ends integers)
      optim_type: {choices: [SGD, AdamW]}
"""
import difflib
import json
import math
from typing import Any, Dict, List, Optional, Sequence

from basetrainer.callbacks.tune_report import pruner_of  # the search and its trials build it alike
from basetrainer.runtime.errors import ConfigError
from basetrainer.utils import setup_config

SETTINGS = {"trials": 12, "timeout": 0, "objective": "", "direction": "", "pruner": "median", "seed": 0,
            "work_dir": "", "study_name": "basetrainer", "params": None}
PRUNERS = ("median", "hyperband", "none")
#: the keys a range or a choice may hold
SPEC_KEYS = ("low", "high", "log", "step", "type", "choices")


class SearchError(ConfigError):
    """A search file or command that cannot run: the message names the key, the value and the fix
    (a ValueError)."""


def load(path: str, known: Sequence[str], typed: Dict[str, Any]) -> Dict[str, Any]:
    """Read and check a search file.

    Args:
        path: the YAML file.
        known: the config keys the script takes (engine keys, its flags, its config file's keys).
        typed: key -> a value of the script's config (its YAML), to check a choice's type against.

    Returns:
        The settings of :data:`SETTINGS`, ``params`` as ``{key: spec}`` with ``spec["type"]`` one
        of float, int, choice.

    Raises:
        SearchError: naming the key, the value and the fix.
    """
    try:
        raw = dict(setup_config.load_config(path))
    except (FileNotFoundError, ValueError) as e:
        raise SearchError(f"--space: {e}") from None
    unknown = [k for k in raw if k not in SETTINGS]
    if unknown:
        raise SearchError(f"search file {path}: unknown setting {unknown[0]!r}{_close(unknown[0], SETTINGS)}; "
                          f"the settings are {sorted(SETTINGS)} (searched keys go under params:)")
    out = {**SETTINGS, **{k: v for k, v in raw.items() if v is not None}}
    if not isinstance(out["params"], dict) or not out["params"]:
        raise SearchError(f"search file {path}: params = {raw.get('params')!r} must map config keys to ranges or "
                          f"choices, e.g. params: {{lr: {{low: 0.001, high: 0.1, log: true}}}}")
    if out["direction"] not in ("", "maximize", "minimize"):
        raise SearchError(f"search file {path}: direction = {out['direction']!r} must be maximize or minimize")
    pruner = out["pruner"]["type"] if isinstance(out["pruner"], dict) else out["pruner"]
    if pruner not in PRUNERS:
        raise SearchError(f"search file {path}: pruner = {pruner!r} must be one of {list(PRUNERS)}")
    if isinstance(out["trials"], bool) or not isinstance(out["trials"], int) or out["trials"] <= 0:
        raise SearchError(f"search file {path}: trials = {out['trials']!r} must be a positive integer")
    for key in ("timeout", "seed"):
        if isinstance(out[key], bool) or not isinstance(out[key], int) or out[key] < 0:
            raise SearchError(f"search file {path}: {key} = {out[key]!r} must be an integer >= 0")
    try:   # a pruner keyword Optuna does not take is an error now, not a traceback after the check launch
        pruner_of(out["pruner"])
    except (TypeError, ValueError) as e:
        raise SearchError(f"search file {path}: pruner = {out['pruner']!r} is refused by Optuna: {e}; give only "
                          f"the keywords of its pruner class") from None
    out["params"] = {key: _spec(key, spec, known, typed) for key, spec in out["params"].items()}
    return out


def _close(key: str, known: Any) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _spec(key: str, spec: Any, known: Sequence[str], typed: Dict[str, Any]) -> Dict[str, Any]:
    if key not in known:
        raise SearchError(f"params: unknown key {key!r}{_close(key, known)}; search only keys the script's config "
                          f"takes (an engine key, one of the script's flags or a key of its config file)")
    if isinstance(spec, list):
        spec = {"choices": spec}
    if not isinstance(spec, dict):
        raise SearchError(f"params: {key} = {spec!r} must be {{low: .., high: .., log: false}} or {{choices: [..]}}")
    unknown = [k for k in spec if k not in SPEC_KEYS]
    if unknown:
        raise SearchError(f"params: {key}.{unknown[0]} is not a range or choice setting"
                          f"{_close(str(unknown[0]), SPEC_KEYS)}; use {list(SPEC_KEYS)}")
    if "choices" in spec:
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise SearchError(f"params: {key}.choices = {choices!r} must be a non-empty list of values")
        for value in choices:
            _check_value(key, value, typed, what="choice")
        return {"type": "choice", "choices": choices}
    if "low" not in spec or "high" not in spec:
        raise SearchError(f"params: {key} = {spec!r} needs low and high (a range) or choices (a list)")
    low, high, log = spec["low"], spec["high"], bool(spec.get("log", False))
    for name, value in (("low", low), ("high", high)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SearchError(f"params: {key}.{name} = {value!r} must be a finite number")
    kind = spec.get("type") or ("int" if isinstance(low, int) and isinstance(high, int) and not log else "float")
    if kind not in ("int", "float"):
        raise SearchError(f"params: {key}.type = {kind!r} must be int or float (or give choices)")
    if kind == "int" and not all(float(v).is_integer() for v in (low, high)):
        raise SearchError(f"params: {key} is an int range with low = {low!r}, high = {high!r}; give whole numbers "
                          f"as both ends, or type: float")
    step = spec.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float)) or not step > 0
                             or (kind == "int" and not float(step).is_integer())):
        raise SearchError(f"params: {key}.step = {step!r} must be a number > 0 (a whole number for an int range)")
    if step is not None and log:
        raise SearchError(f"params: {key} has step = {step!r} and log: true; Optuna takes one of them, remove the "
                          f"other")
    if low > high:
        raise SearchError(f"params: {key} has low = {low!r} > high = {high!r}; swap them (low <= high)")
    if log and low <= 0:
        raise SearchError(f"params: {key} is a log range with low = {low!r}; a log range needs low > 0 "
                          f"(e.g. low: 1.0e-5), or set log: false")
    for value in (low, high):
        _check_value(key, int(value) if kind == "int" else float(value), typed, what=f"{kind} range end")
    return {"type": kind, "low": low, "high": high, "log": log, "step": step}


def _check_value(key: str, value: Any, typed: Dict[str, Any], what: str) -> None:
    """A value the key's type can take: an engine key's check, else the type in the script's YAML."""
    if key in setup_config.ENGINE_KEYS:
        try:
            setup_config.validate(setup_config.Config({key: value}))
        except (TypeError, ValueError) as e:
            raise SearchError(f"params: {what} {value!r} for {key!r} is refused by the config: {e}") from None
        return
    if key in typed and typed[key] is not None:
        want = type(typed[key])
        ok = isinstance(value, want) or (want is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise SearchError(f"params: {what} {value!r} ({type(value).__name__}) for {key!r} does not fit the "
                              f"script's config, where {key} = {typed[key]!r} ({want.__name__}); give "
                              f"{want.__name__} values")


def suggest(trial: Any, params: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """The config values of one trial (a choice that is a list, e.g. an input size, goes by its text)."""
    values: Dict[str, Any] = {}
    for key, spec in params.items():
        if spec["type"] == "choice":
            labels = [_label(c) for c in spec["choices"]]
            picked = trial.suggest_categorical(key, labels)
            values[key] = spec["choices"][labels.index(picked)]
        elif spec["type"] == "int":
            values[key] = trial.suggest_int(key, int(spec["low"]), int(spec["high"]), step=int(spec["step"] or 1),
                                            log=spec["log"])
        else:
            values[key] = trial.suggest_float(key, float(spec["low"]), float(spec["high"]), log=spec["log"],
                                              step=spec["step"])
    return values


def config_values(spec: Dict[str, Any], stored: Dict[str, Any]) -> Dict[str, Any]:
    """A trial's stored Optuna params as config values (labels of list choices back to lists)."""
    out = {}
    for key, value in stored.items():
        s = spec.get(key)
        if s and s["type"] == "choice":
            labels = [_label(c) for c in s["choices"]]
            out[key] = s["choices"][labels.index(value)] if value in labels else value
        else:
            out[key] = value
    return out


def _label(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else json.dumps(value)


def signature(settings: Dict[str, Any]) -> Dict[str, Any]:
    """What must not change when a study is continued: the space, the objective, the direction."""
    return json.loads(json.dumps({"params": settings["params"], "objective": settings["objective"],
                                  "direction": settings["direction"]}))


def differences(old: Dict[str, Any], new: Dict[str, Any]) -> List[str]:
    """Lines naming what differs between two signatures."""
    lines = []
    for part in ("objective", "direction"):
        if old.get(part) != new.get(part):
            lines.append(f"{part}: {old.get(part)!r} -> {new.get(part)!r}")
    op, np_ = old.get("params", {}), new.get("params", {})
    for key in sorted(set(op) | set(np_)):
        if op.get(key) != np_.get(key):
            lines.append(f"params.{key}: {op.get(key)!r} -> {np_.get(key)!r}")
    return lines
