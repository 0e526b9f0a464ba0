"""What a person reads after a search: the trials table (markdown, CSV), the best config as a YAML
the script accepts, Optuna's history and importance plots (PNG), and TensorBoard's HParams view."""
import csv
import io
import json
import logging
import os
import shutil
from typing import Any, Dict, List

from basetrainer.runtime import atomic
from basetrainer.utils import setup_config

logger = logging.getLogger(__name__)


def rows(study: Any, settings: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per trial: number, state, figure, epochs, seconds, the parameters, the error."""
    from basetrainer.tune import space

    out = []
    for t in study.get_trials(deepcopy=False):
        state = "interrupted" if t.user_attrs.get("interrupted") else t.state.name.lower()
        row = {"number": t.number, "state": state,
               "value": None if t.value is None else round(t.value, 6),
               "epochs": t.user_attrs.get("epochs"), "seconds": t.user_attrs.get("seconds")}
        row.update({k: json.dumps(v) if isinstance(v, list) else v
                    for k, v in space.config_values(settings["params"], t.params).items()})
        row["error"] = t.user_attrs.get("error", "")
        out.append(row)
    return out


def write_tables(study: Any, work_dir: str, settings: Dict[str, Any]) -> None:
    """trials.csv, trials.md and best.yaml (rewritten after every trial)."""
    table = rows(study, settings)
    columns = ["number", "state", "value", "epochs", "seconds", *settings["params"], "error"]
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(table)
    atomic.write_atomically(text.getvalue(), os.path.join(work_dir, "trials.csv"))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in table:
        lines.append("| " + " | ".join("" if row.get(c) is None else str(row.get(c)).replace("|", "\\|")
                                       for c in columns) + " |")
    atomic.write_atomically("\n".join(lines) + "\n", os.path.join(work_dir, "trials.md"))
    write_best(study, work_dir)


def best_trial(study: Any) -> Any:
    """The best complete trial, or None."""
    try:
        return study.best_trial
    except ValueError:   # no complete trial yet
        return None


def write_best(study: Any, work_dir: str) -> None:
    """best.yaml: the best trial's whole config (its run's, the search's key removed), work_dir best/."""
    best = best_trial(study)
    if best is None:
        return
    result_file = os.path.join(work_dir, best.user_attrs.get("folder", ""), "result.json")
    if not os.path.isfile(result_file):
        return
    with open(result_file, encoding="utf-8") as f:
        config = json.load(f).get("config") or {}
    config["work_dir"] = os.path.join(work_dir, "best")
    setup_config.save_config(config, os.path.join(work_dir, "best.yaml"))


def write_all(study: Any, work_dir: str, settings: Dict[str, Any]) -> None:
    """The tables, both plots and the HParams view."""
    write_tables(study, work_dir, settings)
    if best_trial(study) is not None:   # Optuna's plots need a complete trial
        write_plots(study, work_dir)
    write_hparams(study, work_dir, settings)


def write_plots(study: Any, work_dir: str) -> None:
    """history.png and importance.png (matplotlib, Agg) from Optuna's plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as plots

    import warnings

    with warnings.catch_warnings():   # optuna marks its matplotlib plots experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        for name, draw in (("history.png", plots.plot_optimization_history),
                           ("importance.png", plots.plot_param_importances)):
            try:
                ax = draw(study)
            except (ValueError, RuntimeError) as e:   # importance needs 2+ complete trials that differ
                logger.warning("search: %s not drawn: %s", name, e)
                continue
            fig = ax.figure
            fig.set_size_inches(8, 5)
            fig.tight_layout()
            fig.savefig(os.path.join(work_dir, name), dpi=100)
            plt.close(fig)


def write_hparams(study: Any, work_dir: str, settings: Dict[str, Any]) -> None:
    """Every finished trial in TensorBoard's HParams view (work_dir/hparams, rewritten whole)."""
    from torch.utils.tensorboard import SummaryWriter

    folder = os.path.join(work_dir, "hparams")
    shutil.rmtree(folder, ignore_errors=True)   # this search's own folder, written whole each time
    with SummaryWriter(log_dir=folder) as writer:
        for row in rows(study, settings):
            if row["state"] not in ("complete", "pruned"):
                continue
            hparams = {k: row[k] for k in settings["params"]}
            hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in hparams.items()}
            writer.add_hparams(hparams, {"objective": float(row["value"] if row["value"] is not None else "nan"),
                                         "epochs": float(row["epochs"] or 0)},
                               run_name=f"trial_{row['number']:03d}")
