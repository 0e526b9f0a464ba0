"""User errors (basetrainer.runtime.errors): a library call raises them as the built-in type a
caller expects; a command (the examples) shows one line, ``error: <message>``, and exits with
status 2, without a traceback, once also when two DDP ranks hit it; BASETRAINER_TRACEBACK=1 shows
the traceback."""
import os
import subprocess
import sys
import textwrap

import pytest

from basetrainer.runtime import errors
from conftest import ROOT, make_image_folder

EXAMPLE = os.path.join(ROOT, "examples", "example.py")
COMMON = ["--input_size", "32", "32", "--batch_size", "8", "--gpu_id", "--no-progress", "--net_type",
          "shufflenet_v2_x0_5"]


# ------------------------------------------------------------------------------ the library side
@pytest.mark.parametrize("kind, builtin", [(errors.ConfigError, ValueError), (errors.ConfigTypeError, TypeError),
                                           (errors.PathError, FileNotFoundError),
                                           (errors.CheckpointError, ValueError),
                                           (errors.WorkDirError, FileExistsError),
                                           (errors.MissingExtraError, ImportError),
                                           (errors.FolderError, OSError), (errors.RunBusyError, RuntimeError)])
def test_each_kind_is_also_the_builtin_type_callers_catch(kind, builtin):
    with pytest.raises(builtin, match="^the message$") as info:
        raise kind("the message")
    assert isinstance(info.value, errors.UsageError)


def test_the_entry_guard_prints_one_line_and_exits_2(capsys, monkeypatch):
    monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as info:
        with errors.exit_on_usage_error():
            raise errors.ConfigError("config key 'lr' = -1 must be >= 0")
    assert info.value.code == 2
    assert capsys.readouterr().err == "error: config key 'lr' = -1 must be >= 0\n"
    with pytest.raises(ZeroDivisionError):   # a fault of the program keeps its traceback
        with errors.exit_on_usage_error():
            1 / 0
    monkeypatch.setenv(errors.TRACEBACK_ENV, "1")
    with pytest.raises(errors.ConfigError):  # asked for: the exception itself, with its traceback
        with errors.exit_on_usage_error():
            raise errors.ConfigError("x")
    assert capsys.readouterr().err == ""


def test_a_torchrun_rank_other_than_0_leaves_the_message_to_rank_0(capsys, monkeypatch):
    monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, said in (("1", ""), ("0", "error: x\n")):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as info:
            with errors.exit_on_usage_error():
                raise errors.PathError("x")
        assert info.value.code == 2 and capsys.readouterr().err == said


def test_an_srun_task_other_than_0_leaves_the_message_to_task_0(capsys, monkeypatch):
    """Under srun every task printed the error (WORLD_SIZE and RANK are set by launch, later)."""
    monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    for task, said in (("1", ""), ("0", "error: x\n")):
        monkeypatch.setenv("SLURM_PROCID", task)
        with pytest.raises(SystemExit) as info:
            with errors.exit_on_usage_error():
                raise errors.ConfigError("x")
        assert info.value.code == 2 and capsys.readouterr().err == said


def test_srun_with_several_tasks_needs_distributed_and_the_first_nodes_address(monkeypatch):
    """Without --distributed task 0 trained alone and task 1 failed oddly; without MASTER_ADDR
    (and no scontrol) a RuntimeError with a traceback (hostile pass)."""
    from basetrainer.engine.launch import launch

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.delenv("SLURM_STEPID", raising=False)
    ran = []
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)   # sbatch -n 2 running its script itself: one process
    assert launch(ran.append, distributed=False, args=(1,)) is None and ran == [1]
    monkeypatch.setenv("SLURM_STEP_ID", "0")             # a task of srun's step 0
    ran.clear()
    with pytest.raises(errors.ConfigError, match=r"^started by srun with SLURM_NTASKS=2 but distributed is off: "
                                                 r"pass --distributed"):
        launch(ran.append, distributed=False, args=(1,))
    with pytest.raises(errors.ConfigError, match=r"^inside SLURM with several tasks, but the address of the first "
                                                 r"node is unknown .*export MASTER_ADDR"):
        launch(ran.append, num_gpus_per_machine=2, distributed=True, args=(1,))
    assert ran == [] and "RANK" not in os.environ   # nothing ran, and the environment is as it was
    monkeypatch.setenv("SLURM_NTASKS", "1")   # one task: a plain call
    assert launch(ran.append, distributed=False, args=(1,)) is None and ran == [1]


def test_the_library_raises_user_errors_of_the_right_kind(tmp_path):
    from basetrainer.models import build_models
    from basetrainer.utils import setup_config

    with pytest.raises(errors.ConfigError, match="'batch_size' = 0 must be a positive integer"):
        setup_config.validate(setup_config.Config(batch_size=0))
    with pytest.raises(errors.ConfigTypeError, match="'lr' = 'fast'"):
        setup_config.validate(setup_config.Config(lr="fast"))
    with pytest.raises(errors.ConfigError, match="unknown net_type 'resnet_18'"):
        build_models.get_models("resnet_18", [32, 32], 3)


def test_precision_strategy_and_pruning_values_are_config_errors():
    """These were plain ValueErrors: a good message, but a traceback and exit 1 (hostile pass)."""
    import torch

    from basetrainer.engine import precision
    from basetrainer.pruning import options
    from basetrainer.runtime import sharding
    from basetrainer.utils import setup_config

    cpu = torch.device("cpu")
    with pytest.raises(errors.ConfigError, match=r"^amp='fp16' needs a CUDA device"):
        precision.check("fp16", cpu, 1)
    with pytest.raises(errors.ConfigError, match=r"^amp='fp32' is not a precision"):
        precision.check("fp32", cpu, 1)
    with pytest.raises(errors.ConfigError, match=r"^strategy: fsdp shards the model .* and none is initialised"):
        sharding.check_config(setup_config.Config(strategy="fsdp"), cpu, "none")
    with pytest.raises(errors.ConfigError, match=r"^unknown prune_type 'l3'; choose from"):
        options.check_prune_type("l3")
    with pytest.raises(errors.ConfigError, match=r"^sparsity must be in the open interval \(0, 1\), got 2"):
        options.check_sparsity(2)


def test_a_work_dir_that_cannot_be_made_or_written_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    from basetrainer.runtime import run_folder

    (tmp_path / "a_file").write_text("not a folder")
    bad = str(tmp_path / "a_file" / "run" / "w")
    with pytest.raises(errors.FolderError) as info:
        run_folder.check_writable(bad)
    assert str(info.value) == (f"work_dir={bad!r} cannot be made: {tmp_path / 'a_file'} is a file, not a folder; "
                               f"give work_dir a folder path")
    run_folder.check_writable(str(tmp_path / "new" / "w"))   # a folder that can be made: fine
    assert not (tmp_path / "new").exists()                    # and nothing made by the check
    monkeypatch.setattr(os, "access", lambda path, mode: False)   # a read-only disk (root may write anywhere else)
    with pytest.raises(errors.FolderError, match=f"^work_dir='{tmp_path}/new/w' cannot be written: {tmp_path} is "
                                                 f"read-only for this user"):
        run_folder.check_writable(str(tmp_path / "new" / "w"))


def test_a_finished_run_kept_read_only_can_still_be_continued_or_evaluated(tmp_path, monkeypatch):
    """The read-only check is for a run that will write: resume: auto of a finished run (to
    evaluate it) writes nothing (it was refused: hostile pass)."""
    from conftest import ToyTrainer, toy_cfg

    from basetrainer.callbacks.losses_recorder import LossesRecorder
    from basetrainer.callbacks.model_checkpoint import ModelCheckpoint

    work = str(tmp_path / "work")
    ToyTrainer(toy_cfg(num_epochs=1, n_train=32, n_test=8, work_dir=work),
               callbacks=[LossesRecorder(), ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="loss",
                                                            async_save=False)]).run()
    monkeypatch.setattr(os, "access", lambda path, mode: False)   # as on a read-only mount
    t = ToyTrainer(toy_cfg(num_epochs=1, n_train=32, n_test=8, work_dir=work, resume="auto"))
    assert t.cfg.resume
    with pytest.raises(errors.FolderError, match="cannot be written"):   # a new run would write there
        ToyTrainer(toy_cfg(num_epochs=1, n_train=32, n_test=8, work_dir=str(tmp_path / "other")))


def test_a_file_where_a_run_makes_a_folder_is_one_user_error(tmp_path):
    """A file named ``model`` or ``log`` in work_dir: the example exited 1 with a FileExistsError
    traceback (hostile pass)."""
    from basetrainer.utils.file_utils import create_dir

    (tmp_path / "model").write_text("")
    for sub in ("model", os.path.join("model", "best")):
        with pytest.raises(errors.FolderError) as info:
            create_dir(str(tmp_path / sub))
        assert str(info.value) == (f"cannot make the folder {str(tmp_path / sub)!r}: {tmp_path / 'model'} is a file, "
                                   f"not a folder; remove or rename it, or give work_dir another folder")


def test_a_missing_extra_names_its_pip_command_once(monkeypatch, tmp_path):
    from basetrainer.deploy.export import export_model

    for module in ("onnx", "onnxslim", "MNN"):   # hidden: importing them fails
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(errors.MissingExtraError) as info:
        export_model(str(tmp_path / "never-read.pth"), "onnx,mnn", out_dir=str(tmp_path / "out"))
    # before: 'pip install "basetrainer[export]"' 4 times and '...[mnn]' once, one per package and format
    assert str(info.value) == ('runtimes missing for the formats asked for: onnx: onnx, onnxslim | mnn: onnx, '
                               'onnxslim, MNN; install them: pip install "basetrainer[export,mnn]" (or pip install '
                               'onnx onnxslim mnn)')


# ------------------------------------------------------------------------------ the command side
def _start(args, cwd, env=None, prelude=""):
    """examples/example.py ``args`` (``prelude``: Python run first in its process, e.g. to hide a
    package); stdout and stderr apart."""
    given, env = env or {}, dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop(errors.TRACEBACK_ENV, None)
    env.update(given)
    code = (f"import runpy, sys; {prelude or 'pass'}; sys.argv = [{EXAMPLE!r}] + {list(args)!r}; "
            f"runpy.run_path({EXAMPLE!r}, run_name='__main__')")
    return subprocess.Popen([sys.executable, "-c", code], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """Every command at once (they spend their time importing); name -> (exit status, stdout, stderr)."""
    root = tmp_path_factory.mktemp("errors")
    train = make_image_folder(str(root / "train"), ["a", "b"], per_class=4, size=16)
    used = root / "used"
    (used / "model").mkdir(parents=True)
    (used / "model" / "last.pth").write_bytes(b"")   # another run's checkpoint: a new run there is refused
    (root / "a_file").write_text("not a folder")
    config = root / "bad.yaml"
    config.write_text("lr: fast\n")
    (root / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")   # the text of /etc/passwd
    srun = {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}
    data = ["--train_data", train]
    runs = {
        "work_dir": (data + ["--work_dir", str(used)] + COMMON, {}, ""),
        "work_dir_ddp": (data + ["--work_dir", str(used), "--distributed"] + COMMON + ["--gpu_id", "0", "1"], {}, ""),
        "traceback": (data + ["--work_dir", str(used)] + COMMON, {errors.TRACEBACK_ENV: "1"}, ""),
        "data": (["--train_data", str(root / "no_such_folder"), "--work_dir", str(root / "w1")] + COMMON, {}, ""),
        "folder": (data + ["--work_dir", str(root / "a_file" / "w")] + COMMON, {}, ""),
        "flag": (data + ["--work_dir", str(root / "w2")] + COMMON + ["--batch_size", "0"], {}, ""),
        "yaml": (data + ["--work_dir", str(root / "w3"), "-c", str(config)] + COMMON, {}, ""),
        "extra": (data + ["--work_dir", str(root / "w4"), "--loggers", "mlflow"] + COMMON, {},
                  "sys.modules['mlflow'] = None"),
        "checkpoint": (data + ["--work_dir", str(root / "w5"), "--finetune", str(root / "passwd")] + COMMON, {}, ""),
        "srun_task0": (data + ["--work_dir", str(root / "w6")] + COMMON, srun, ""),
        "srun_task1": (data + ["--work_dir", str(root / "w6")] + COMMON, dict(srun, SLURM_PROCID="1"), ""),
    }
    procs = {name: _start(args, str(root), env, prelude) for name, (args, env, prelude) in runs.items()}
    results = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=240)
            results[name] = (proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return root, results


def _one_error(result):
    """The one ``error:`` line of a command that exited with status 2 (stderr holds nothing else
    but warnings, and no traceback)."""
    code, out, err = result
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len([x for x in lines if "error:" in x]) == 1, err
    return lines[-1]


@pytest.mark.distributed
def test_a_refused_work_dir_is_one_line(commands):
    root, results = commands
    line = _one_error(results["work_dir"])
    assert results["work_dir"][2].splitlines()[0] == line   # the first line the user sees
    used = os.path.join(str(root), "used")
    assert line == (f"error: work_dir={used!r} already holds the files of another run "
                    f"({os.path.join(used, 'model', 'last.pth')}); a new run there would mix with them or replace "
                    f"them. Continue that run with resume: auto (--resume auto), give this run another work_dir, or "
                    f"set overwrite: true (--overwrite) to move the old run aside to <folder>.old-<time> and start "
                    f"afresh")


@pytest.mark.distributed
def test_two_ranks_with_the_same_user_error_say_it_once_and_all_exit(commands):
    _, results = commands
    line = _one_error(results["work_dir_ddp"])   # launch() raised it once in the launching process
    assert line == _one_error(results["work_dir"])


@pytest.mark.distributed
def test_the_traceback_when_asked_for(commands):
    code, _, err = commands[1]["traceback"]
    assert code == 1 and err.startswith("Traceback") and "WorkDirError: work_dir=" in err


@pytest.mark.distributed
def test_a_missing_data_folder_is_one_line(commands):
    root, results = commands
    line = _one_error(results["data"])
    assert results["data"][2].splitlines()[0] == line
    missing = os.path.join(str(root), "no_such_folder")
    assert line == (f"error: train_data={missing!r} does not exist or is not a folder: it must hold one subfolder "
                    f"of images per class")


@pytest.mark.distributed
def test_a_bad_value_on_the_command_line_or_in_yaml_is_one_line(commands):
    _, results = commands
    assert results["flag"][2].splitlines()[0] == _one_error(results["flag"]) == \
        "error: config key 'batch_size' = 0 must be a positive integer"
    assert results["yaml"][2].splitlines()[0] == _one_error(results["yaml"]) == \
        "error: config key 'lr' = 'fast' (str) must be a number (initial learning rate (after warm-up): finite, >= 0 " \
        "(0 = weights stay))"


@pytest.mark.distributed
def test_a_missing_extra_is_one_line_with_its_pip_command(commands):
    _, results = commands
    line = _one_error(results["extra"])
    assert results["extra"][2].splitlines()[0] == line == (
        'error: loggers: mlflow (MLflowLogger) needs the mlflow package, which is not installed: '
        'pip install "basetrainer[mlflow]"')


@pytest.mark.distributed
def test_a_work_dir_under_a_file_is_one_line(commands):
    root, results = commands
    line = _one_error(results["folder"])
    assert results["folder"][2].splitlines()[-1] == line
    bad = os.path.join(str(root), "a_file", "w")
    assert line == (f"error: work_dir={bad!r} cannot be made: {os.path.join(str(root), 'a_file')} is a file, "
                    f"not a folder; give work_dir a folder path")


@pytest.mark.distributed
def test_a_file_that_is_no_checkpoint_is_one_line(commands):
    root, results = commands
    line = _one_error(results["checkpoint"])   # before: IndexError from torch's unpickler, a traceback, exit 1
    passwd = os.path.join(str(root), "passwd")
    assert line == (f"error: checkpoint file {passwd!r} is truncated or not a torch file (torch.load: IndexError); "
                    f"give a file written by torch.save (a checkpoint or a state_dict)")


@pytest.mark.distributed
def test_srun_tasks_without_distributed_are_refused_by_task_0_only(commands):
    _, results = commands
    assert _one_error(results["srun_task0"]) == (
        "error: started by srun with SLURM_NTASKS=2 but distributed is off: pass --distributed (or set "
        "distributed: true in the config), or start one task (srun --ntasks 1)")
    code, out, err = results["srun_task1"]
    assert code == 2 and "error:" not in err and "Traceback" not in err, err
    assert "basetrainer " not in out and "basetrainer " in results["srun_task0"][1], out   # the banner: task 0's
