"""What examples/example.py leaves behind with its defaults (progress on, start_save from the
config): no progress-bar redraws in output that is not a terminal (CI logs, nohup, SLURM files),
bars in a terminal, and only best + last weights on disk."""
import fcntl
import os
import re
import struct
import subprocess
import sys
import termios
import threading

import pytest
import yaml

from conftest import ROOT, make_image_folder

EXAMPLE = os.path.join(ROOT, "examples", "example.py")
CLASSES = ["ant", "bee", "cat"]


def _args(root, work):
    return ["--train_data", str(root / "train"), "--test_data", str(root / "val"),
            "--net_type", "shufflenet_v2_x0_5", "--input_size", "32", "32", "--batch_size", "8",
            "--gpu_id", "--num_workers", "0", "--num_epochs", "2", "--lr", "0.01", "--log_freq", "1",
            "--work_dir", str(work)]      # no --progress / --no-progress: the config's default


def _env():
    return dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="120")


class _PtyRun:
    """The example with stdout and stderr on a pseudo-terminal (what a person's terminal is)."""

    def __init__(self, args, cwd):
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.proc = subprocess.Popen([sys.executable, EXAMPLE, *args], cwd=cwd, env=_env(),
                                     stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
        os.close(slave)
        self.chunks = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:   # EIO: the last writer closed the terminal
                return
            if not data:
                return
            self.chunks.append(data)

    def finish(self, timeout):
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.reader.join(timeout=30)
            os.close(self.master)
        return code, b"".join(self.chunks)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run with stdout and stderr as pipes, one on a pseudo-terminal, side by side."""
    root = tmp_path_factory.mktemp("example_output")
    make_image_folder(str(root / "train"), CLASSES, per_class=8, size=16)
    make_image_folder(str(root / "val"), CLASSES, per_class=4, size=16)
    piped = subprocess.Popen([sys.executable, EXAMPLE, *_args(root, root / "piped")], cwd=str(root), env=_env(),
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        tty = _PtyRun(_args(root, root / "tty"), cwd=str(root))
        no_tty = None
    except OSError as e:
        tty, no_tty = None, f"no pseudo-terminal can be had here: {e}"
    try:
        out, err = piped.communicate(timeout=300)
    finally:
        if piped.poll() is None:
            piped.kill()
    tty_result = tty.finish(timeout=300) if tty is not None else None
    return root, (piped.returncode, out, err), tty_result, no_tty


@pytest.mark.distributed
@pytest.mark.slow
def test_no_progress_bars_in_output_that_is_not_a_terminal(runs):
    root, (code, out, err), _, _ = runs
    assert code == 0, (out + err).decode(errors="replace")
    assert out.count(b"\r") == 0 and err.count(b"\r") == 0
    assert b"Train epoch" not in out + err and b"it/s" not in out + err
    text = out.decode()
    # the progress report there is LogHistory's line every log_freq (1) steps: 3 steps x 2 epochs
    steps = re.findall(r"epoch (\d)/2 step (\d)/3 ", text)
    assert steps == [(str(e), str(s)) for e in range(2) for s in (1, 2, 3)], text
    assert max(len(line) for line in (out + err).splitlines()) < 400
    saved = yaml.safe_load(open(root / "piped" / "setup_config.yaml"))
    assert saved["progress"] is True          # the default was on: the bars were dropped, not turned off


@pytest.mark.distributed
@pytest.mark.slow
def test_a_terminal_shows_the_bars(runs):
    _, _, tty_result, no_tty = runs
    if tty_result is None:
        pytest.skip(no_tty)
    code, text = tty_result
    assert code == 0, text.decode(errors="replace")
    # the terminal turns every "\n" into "\r\n"; a bar's redraw is a "\r" that no "\n" follows
    # (each of the 4 bars: at least its first draw and the "\r" that clears it)
    redraws = len(re.findall(rb"\r(?!\n)", text))
    assert redraws >= 8, text.decode(errors="replace")[-3000:]
    for phase in (b"Train epoch 0", b"Test  epoch 0", b"Train epoch 1", b"Test  epoch 1"):
        assert phase in text
    assert re.search(rb"Train epoch 1: +\d+%[^\r\n]*\| *[0-3]/3 \[", text)
    assert b"final test/Accuracy:" in text


@pytest.mark.distributed
@pytest.mark.slow
def test_only_best_and_last_weights_by_default(runs):
    root, (code, out, err), _, _ = runs
    assert code == 0
    files = sorted(f for f in os.listdir(root / "piped" / "model") if not f.startswith("."))   # not the run marker
    assert len(files) == 3 and files[1:] == ["last.prev.pth", "last.pth"], files
    assert re.fullmatch(r"best_model_00[01]_\d\.\d{4}\.pth", files[0]), files
    saved = yaml.safe_load(open(root / "piped" / "setup_config.yaml"))
    assert saved["start_save"] == 0
