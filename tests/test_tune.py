"""Hyperparameter search (basetrainer.tune): the search file's checks, a search over a toy script
of 2-process DDP trials (failed, pruned and complete; SIGKILLed and continued; the same parameters
and the same last epoch on every rank; best.yaml reproduces; the table and plots), NNI's trial API."""
import csv
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import ROOT, run_script, script_fixture

PY = sys.executable

# A user's script as basetrainer scripts are written: argparse + parser_config + a trainer + launch.
# Nothing in it knows about the search. It imports torch after parsing its arguments, so the
# search's ``--help`` call costs no torch import (the test's time, not a requirement).
SCRIPT = '''
import argparse, sys
sys.path.insert(0, {tests!r}); sys.path.insert(0, {root!r})


def main(cfg):
    from toys import ToyTrainer
    from basetrainer.callbacks import losses_recorder, model_checkpoint
    from basetrainer.metric import accuracy_recorder

    class Trainer(ToyTrainer):
        def build_callbacks(self, cfg, **kwargs):
            return [accuracy_recorder.AccuracyRecorder(indicator="Accuracy"), losses_recorder.LossesRecorder(indicator="loss"),
                    model_checkpoint.ModelCheckpoint(model=self.model, optimizer=self.optimizer, model_dir=cfg.work_dir + "/model",
                                                     epochs=cfg.num_epochs, indicator="Accuracy")]

    history = Trainer(cfg).run()
    if cfg.get("show_figure") and history.last is not None:
        print("FIGURE", max(history["test/Accuracy"]), flush=True)
        print("TRAINED", cfg.lr, cfg.num_epochs, history["test/Accuracy"], flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("-c", "--config_file", default="")
    p.add_argument("--work_dir", default="work")
    p.add_argument("--num_epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--gpu_id", nargs="*", type=int, default=[])
    p.add_argument("--distributed", action="store_true")
    p.add_argument("--show_figure", action="store_true")
    args = p.parse_args()
    from basetrainer.engine.launch import launch
    from basetrainer.utils import setup_config

    cfg = setup_config.parser_config(args, cfg_updata=True, parser=p)
    cfg.update(progress=False, n_train=96, n_test=64, log_freq=100, seed=cfg.get("seed", 0))
    launch(main, num_gpus_per_machine=max(1, len(cfg.gpu_id)), dist_url="auto", distributed=cfg.distributed,
           args=(cfg,))
'''
script = script_fixture(SCRIPT, "train_toy.py")


def _space(path, **settings):
    with open(path, "w") as f:
        yaml.safe_dump(settings, f)
    return str(path)


def _tune(script, space, *args, **kw):
    return subprocess.run([PY, "-m", "basetrainer.tune", script, "--space", space, *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=kw.get("timeout", 300))


def _rows(work):
    with open(os.path.join(work, "trials.csv")) as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------ the search file, before any trial
KNOWN = ["lr", "batch_size", "optim_type", "momentum", "net_type", "my_depth"]


@pytest.mark.parametrize("params, message", [
    ({"lrr": {"low": 0.1, "high": 1.0}}, r"unknown key 'lrr' \(did you mean 'lr'\?\)"),
    ({"lr": {"low": 0.5, "high": 0.1}}, r"lr has low = 0.5 > high = 0.1; swap them"),
    ({"lr": {"low": 0.0, "high": 0.1, "log": True}}, r"lr is a log range with low = 0.0; a log range needs low > 0"),
    ({"batch_size": {"choices": [16, "big"]}}, r"choice 'big' for 'batch_size' is refused by the config: .*integer"),
    ({"my_depth": {"choices": [2, "deep"]}}, r"choice 'deep' \(str\) for 'my_depth' does not fit .*my_depth = 3 \(int\)"),
])
def test_bad_search_file_names_key_value_and_fix(tmp_path, params, message):
    from basetrainer.tune import space

    path = _space(tmp_path / "s.yaml", params=params)
    with pytest.raises(space.SearchError, match=message):
        space.load(path, KNOWN, {"my_depth": 3})


def test_changed_space_on_rerun_is_an_error_naming_the_difference(tmp_path):
    from basetrainer.tune import search, space

    first = space.load(_space(tmp_path / "a.yaml", params={"lr": {"low": 0.01, "high": 0.1}}), KNOWN, {})
    search.Search("x.py", [], first, str(tmp_path / "w")).open_study()
    second = space.load(_space(tmp_path / "b.yaml", params={"lr": {"low": 0.01, "high": 0.2}}), KNOWN, {})
    with pytest.raises(space.SearchError, match=r"params.lr: .*'high': 0.1.* -> .*'high': 0.2"):
        search.Search("x.py", [], second, str(tmp_path / "w")).open_study()
    search.Search("x.py", [], first, str(tmp_path / "w")).open_study()   # the same one continues


@pytest.mark.distributed
@pytest.mark.parametrize("settings, line", [
    ({"params": {"lrr": {"low": 0.01, "high": 0.1}}},
     "params: unknown key 'lrr' (did you mean 'lr'?); search only keys the script's config takes (an engine key, "
     "one of the script's flags or a key of its config file)"),
    ({"objective": "F1", "params": {"lr": {"low": 0.01, "high": 0.1}}},   # found by the check launch
     "objective 'test/F1' is not a figure of this run (its recorders write ['train/Accuracy', 'test/Accuracy', "
     "'train/loss', 'test/loss']); set objective in the search file, or --objective, to one of them"),
])
def test_cli_bad_input_exits_2_with_one_line_before_any_trial(script, tmp_path, settings, line):
    work = tmp_path / "w"
    out = _tune(script, _space(tmp_path / "s.yaml", work_dir=str(work), **settings))
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == ["basetrainer.tune: error: " + line]
    assert "Traceback" not in out.stderr and not os.path.exists(work / "trials") and not os.path.exists(work / "check")
    if os.path.exists(work / "study.db"):   # the check launch is not a trial
        import optuna

        assert optuna.load_study(study_name="basetrainer", storage=f"sqlite:///{work / 'study.db'}").trials == []


# ------------------------------------------------------------------ a search, killed and continued
@pytest.fixture(scope="module")
def killed_search(script, tmp_path_factory):
    """A search of 2-process DDP trials (gloo). Seed 6 draws lr 0.3 (complete), 1e30 (diverges:
    failed, its error recorded), 0.0001 (below the median after one epoch: pruned). The search
    is SIGKILLed in its second trial and the same command continues it. Returns (work_dir, the
    table after the kill, the table at the end)."""
    tmp = tmp_path_factory.mktemp("killed")
    work = str(tmp / "search")
    space_file = _space(tmp / "s.yaml", trials=3, seed=6, work_dir=work,
                        pruner={"type": "median", "n_startup_trials": 1, "n_warmup_steps": 0},
                        params={"lr": {"choices": [0.3, 0.0001, 1.0e30]}})
    cmd = [PY, "-m", "basetrainer.tune", script, "--space", space_file, "--num_epochs", "2", "--distributed",
           "--gpu_id", "0", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    while not os.path.exists(os.path.join(work, "trials", "001", "trial.yaml")) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)     # the search and its trial, as a job scheduler kills a job
    proc.wait(timeout=30)
    first = _rows(work)
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return work, first, _rows(work)


@pytest.mark.slow
@pytest.mark.distributed
def test_search_killed_and_continued_loses_no_trial(killed_search):
    work, first, rows = killed_search
    assert [(r["state"], r["lr"]) for r in first] == [("complete", "0.3")]
    assert rows[0] == first[0]                                              # the finished trial is kept
    assert [(r["state"], r["lr"]) for r in rows[1:]] == [("interrupted", "1e+30"), ("fail", "1e+30"),
                                                         ("pruned", "0.0001")]
    assert "FloatingPointError" in rows[2]["error"]
    assert int(rows[3]["epochs"]) == 1 and rows[0]["epochs"] == "2"


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_trials_same_parameters_and_same_last_epoch_on_every_rank(killed_search):
    """Read back from each rank: the values it trained with, its last epoch, its pruned epoch."""
    work, _, rows = killed_search
    for row in rows:
        if row["state"] == "interrupted":   # killed: its ranks wrote nothing
            continue
        ranks = []
        for r in (0, 1):
            with open(os.path.join(work, "trials", f"{int(row['number']):03d}", f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        assert ranks[0]["params"] == ranks[1]["params"] == {"lr": float(row["lr"])}
        assert ranks[0]["pruned_epoch"] == ranks[1]["pruned_epoch"]
        if row["state"] != "fail":
            assert ranks[0]["last_epoch"] == ranks[1]["last_epoch"] == int(row["epochs"]) - 1
    assert rows[3]["state"] == "pruned" and ranks[0]["pruned_epoch"] == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_search_results_table_plots_and_best_yaml_that_reproduces(killed_search, script):
    work, _, rows = killed_search
    for name in ("trials.md", "history.png", "importance.png", "best.yaml"):
        assert os.path.getsize(os.path.join(work, name)) > 0
    assert glob.glob(os.path.join(work, "hparams", "trial_*", "events.out.tfevents.*"))
    with open(os.path.join(work, "best.yaml")) as f:
        best_cfg = yaml.safe_load(f)
    assert best_cfg["lr"] == 0.3 and "tune" not in best_cfg
    again = run_script(script, "-c", os.path.join(work, "best.yaml"), "--show_figure")
    figure = [line for line in again.stdout.splitlines() if line.startswith("FIGURE")]
    assert figure and abs(float(figure[0].split()[1]) - float(rows[0]["value"])) < 1e-6, again.stdout + again.stderr


# ------------------------------------------------------------------ NNI's trial API
@pytest.mark.distributed
def test_nni_trial_takes_nni_parameters_and_reports_each_epoch_and_the_best(script, tmp_path):
    """The script runs as NNI's local trial runner starts it (NNI_PLATFORM=local, the parameters in
    NNI_SYS_DIR/parameter.cfg, the figures appended to NNI_SYS_DIR/.nni/metrics); no NNI manager
    runs. NNI's lr and num_epochs win over the typed --lr and the script's default of 3 epochs."""
    sys_dir = tmp_path / "nni_sys"
    sys_dir.mkdir()
    (sys_dir / "parameter.cfg").write_text(json.dumps({"parameter_id": 7, "parameters": {"lr": 0.05, "num_epochs": 2}}))
    env = {**os.environ, "NNI_PLATFORM": "local", "NNI_SYS_DIR": str(sys_dir), "NNI_OUTPUT_DIR": str(sys_dir),
           "NNI_TRIAL_JOB_ID": "trial7", "NNI_EXP_ID": "exp"}
    out = run_script(script, "--work_dir", str(tmp_path / "nni"), "--lr", "0.3", "--show_figure", env=env)
    try:
        import nni  # noqa: F401
    except ImportError:
        assert out.returncode != 0 and 'pip install "basetrainer[nni]"' in out.stderr
        return
    assert out.returncode == 0, out.stdout + out.stderr
    printed = (sys_dir / "trial.log").read_text()   # NNI sends a trial's prints to NNI_OUTPUT_DIR/trial.log
    trained = [line.split("PRINT TRAINED ")[1].split(" ", 2) for line in printed.splitlines() if "PRINT TRAINED" in line]
    assert trained and trained[0][:2] == ["0.05", "2"], printed
    figures = json.loads(trained[0][2])
    sent = []
    data = (sys_dir / ".nni" / "metrics").read_bytes()
    while data:   # NNI's record: b"ME" + 6-digit length + JSON line
        assert data[:2] == b"ME", data[:20]
        size = int(data[2:8])
        sent.append(json.loads(data[8:8 + size]))
        data = data[8 + size:]
    assert [(m["type"], m["sequence"], m["parameter_id"]) for m in sent] == [
        ("PERIODICAL", 0, 7), ("PERIODICAL", 1, 7), ("FINAL", 0, 7)]
    assert [json.loads(m["value"]) for m in sent] == pytest.approx(figures + [max(figures)])


def test_import_basetrainer_imports_no_search_package():
    code = "import sys, basetrainer, basetrainer.callbacks.tune_report; print([m for m in ('optuna', 'nni') if m in sys.modules])"
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
