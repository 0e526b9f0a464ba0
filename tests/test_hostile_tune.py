"""Regressions from a hostile pass on the hyperparameter search (issue 37): search files and flags
that used to run silently wrong or end in a traceback are each one SearchError (exit status 2)
before any trial runs."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("optuna")

from basetrainer.tune import space  # noqa: E402

KNOWN = ["lr", "batch_size", "num_epochs", "weight_decay"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(tmp_path, text):
    path = tmp_path / "search.yaml"
    path.write_text(text)
    return space.load(str(path), KNOWN, {})


@pytest.mark.parametrize("text, words", [
    # an int range with fractional ends was truncated silently (8.5 -> 8)
    ("params:\n  batch_size: {low: 8.5, high: 32.0, type: int}\n", ["batch_size", "int range", "8.5"]),
    # a misspelt range setting (lg for log) was ignored silently
    ("params:\n  lr: {low: 0.01, high: 0.1, lg: true}\n", ["lr.lg", "'log'"]),
    # step 0 reached Optuna as a traceback
    ("params:\n  lr: {low: 0.01, high: 0.1, step: 0.0}\n", ["lr.step", "0.0", "> 0"]),
    ("params:\n  lr: {low: 0.01, high: 0.1, step: 0.01, log: true}\n", ["lr", "step", "log"]),
    # a pruner keyword Optuna does not take was a TypeError traceback after the check launch
    ("pruner: {type: median, bogus: 1}\nparams:\n  lr: {low: 0.01, high: 0.1}\n", ["pruner", "bogus"]),
    # a negative timeout ended the search at once, reporting 'time budget spent'
    ("timeout: -5\nparams:\n  lr: {low: 0.01, high: 0.1}\n", ["timeout", "-5", ">= 0"]),
    # a string seed was a TypeError traceback in open_study
    ("seed: abc\nparams:\n  lr: {low: 0.01, high: 0.1}\n", ["seed", "'abc'"]),
])
def test_bad_search_file_is_one_error(tmp_path, text, words):
    with pytest.raises(space.SearchError) as e:
        _load(tmp_path, text)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_good_int_range_with_whole_float_ends_and_step(tmp_path):
    settings = _load(tmp_path, "params:\n  batch_size: {low: 8.0, high: 32.0, type: int, step: 8}\n"
                               "  lr: {low: 0.1, high: 0.5, step: 0.1}\n")
    assert settings["params"]["batch_size"] == {"type": "int", "low": 8.0, "high": 32.0, "log": False, "step": 8}
    assert settings["params"]["lr"]["step"] == 0.1


@pytest.mark.parametrize("flag, value", [("--trials", "0"), ("--trials", "-3"), ("--timeout", "-5")])
def test_bad_budget_flags_exit_2_before_any_trial(tmp_path, flag, value):
    script = tmp_path / "script.py"
    script.write_text("import argparse\nargparse.ArgumentParser().parse_args()\n")
    search = tmp_path / "search.yaml"
    search.write_text("params:\n  lr: {low: 0.01, high: 0.1}\n")
    out = subprocess.run([sys.executable, "-m", "basetrainer.tune", str(script), "--space", str(search), flag, value,
                          "--work_dir", str(tmp_path / "w")], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert f"{flag} = '{value}'" in out.stderr
    assert not (tmp_path / "w" / "trials").exists()


def test_without_optuna_one_error_naming_the_extra(tmp_path):
    code = ("import sys; sys.modules['optuna'] = None\n"
            "from basetrainer.tune.__main__ import main\n"
            f"sys.exit(main([{str(tmp_path / 's.py')!r}, '--space', 'x.yaml']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip() == ('basetrainer.tune: error: the search needs Optuna, which is not installed: '
                                  'pip install "basetrainer[tune]"')


def test_trial_killed_by_a_signal_is_failed_by_name_and_the_search_goes_on(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text("import argparse, os, signal\nargparse.ArgumentParser().add_argument('--lr', type=float)\n"
                      "if os.environ.get('BASETRAINER_TRIAL'):\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    search = tmp_path / "search.yaml"
    search.write_text("trials: 2\npruner: none\nparams:\n  lr: {low: 0.01, high: 0.1}\n")
    out = subprocess.run([sys.executable, "-m", "basetrainer.tune", str(script), "--space", str(search),
                          "--work_dir", str(tmp_path / "w")], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    lines = (tmp_path / "w" / "trials.csv").read_text().splitlines()
    assert len(lines) == 3
    assert all(",fail," in line and line.endswith(",\"killed by SIGKILL, state None\"") for line in lines[1:]), lines


def test_full_disk_is_one_line_not_a_traceback(monkeypatch, capsys):
    from sqlalchemy.exc import OperationalError

    from basetrainer.tune import __main__ as cli
    from basetrainer.tune import search

    def full(*args, **kwargs):   # what SQLite said on a full 1 MiB tmpfs work_dir
        raise OperationalError("COMMIT", {}, Exception("database or disk is full"))

    monkeypatch.setattr(search, "split_args", full)
    assert cli.main(["s.py", "--space", "x.yaml"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "database or disk is full" in err[0] and "run the same command again" in err[0], err


def test_main_called_from_python_leaves_the_callers_logging_alone(monkeypatch):
    # CI at 3b499d0: main() configured the basetrainer logger (propagate off, a handler on the
    # captured stdout); every later test in the process lost its log records (13 failed on pytest 7.4)
    import logging

    from basetrainer.tune import __main__ as cli
    from basetrainer.tune import search

    def stop(*args, **kwargs):
        raise RuntimeError("stop here")

    monkeypatch.setattr(search, "split_args", stop)
    lib = logging.getLogger("basetrainer")
    before = (list(lib.handlers), lib.propagate, lib.level)
    with pytest.raises(RuntimeError):
        cli.main(["s.py", "--space", "x.yaml"])
    assert (list(lib.handlers), lib.propagate, lib.level) == before


@pytest.mark.parametrize("epochs, pruned_epoch, state", [(2, 0, "pruned"), (1, None, "complete")])
def test_a_trial_judged_worse_after_its_last_epoch_is_complete_not_pruned(tmp_path, epochs, pruned_epoch, state):
    # the digits search had trials "pruned" after their last epoch: nothing was saved by stopping them
    optuna = pytest.importorskip("optuna")
    from optuna.distributions import FloatDistribution

    from basetrainer.callbacks.losses_recorder import LossesRecorder
    from basetrainer.callbacks.tune_report import TuneReport
    from conftest import ToyTrainer, toy_cfg

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=storage, direction="minimize")
    study.add_trial(optuna.trial.create_trial(params={"lr": 0.1}, distributions={"lr": FloatDistribution(0.01, 1)},
                                              value=0.0, intermediate_values={0: 0.0, 1: 0.0}))
    trial = study.ask()   # worse than the median (0.0) at every epoch: MedianPruner prunes it when asked
    report = TuneReport({"storage": storage, "study": "s", "trial": trial.number, "objective": "train/loss",
                         "direction": "minimize", "pruner": {"type": "median", "n_startup_trials": 0},
                         "params": [], "result": str(tmp_path / "result.json")})
    ToyTrainer(toy_cfg(num_epochs=epochs), callbacks=[LossesRecorder(indicator="loss"), report]).run()
    result = json.loads((tmp_path / "result.json").read_text())
    assert (report.pruned_epoch, result["state"], len(result["values"])) == (pruned_epoch, state, 1)
