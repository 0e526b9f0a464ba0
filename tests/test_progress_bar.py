"""ProgressBar: bars only where a person watches (a terminal or Jupyter), unless told."""
import io
import os
import sys
import types

import pytest

from basetrainer.callbacks import progress_bar
from basetrainer.callbacks.progress_bar import ProgressBar, is_interactive
from conftest import ToyTrainer, toy_cfg


def _run(bar):
    t = ToyTrainer(toy_cfg(n_train=64, n_test=32, num_epochs=2), callbacks=[bar])
    t.run()
    return t


def test_a_file_gets_no_bars_by_default():
    stream = io.StringIO()
    t = _run(ProgressBar(file=stream))
    assert t.num_steps == 4 and stream.getvalue() == ""


def test_enabled_true_draws_every_phase_into_any_stream():
    stream = io.StringIO()
    _run(ProgressBar(enabled=True, file=stream))
    text = stream.getvalue()
    for phase in ("Train epoch 0", "Test  epoch 0", "Train epoch 1", "Test  epoch 1"):
        assert phase in text
    assert "0/4" in text and "0/2" in text      # 64 / 16 train steps, 32 / 16 test steps
    assert text.count("\r") >= 8               # each bar drawn, then cleared (leave=False)


def test_enabled_false_draws_nothing_on_a_terminal():
    try:
        master, slave = os.openpty()
    except OSError as e:
        pytest.skip(f"no pseudo-terminal: {e}")
    with open(slave, "w") as tty:
        bar = ProgressBar(enabled=False, file=tty)
        _run(bar)
        assert bar._show is None and bar._bar is None     # reset at the end, never opened
    os.close(master)


def test_is_interactive_for_terminals_files_and_closed_streams(tmp_path):
    try:
        master, slave = os.openpty()
    except OSError as e:
        pytest.skip(f"no pseudo-terminal: {e}")
    with open(slave, "w") as tty:
        assert is_interactive(tty) is True
    os.close(master)
    with open(tmp_path / "log.txt", "w") as f:
        assert is_interactive(f) is False
    closed = io.StringIO()
    closed.close()
    assert is_interactive(closed) is False
    assert is_interactive(object()) is False


def test_a_jupyter_kernel_counts_as_interactive(monkeypatch):
    stream = io.StringIO()
    assert is_interactive(stream) is False
    shell = types.SimpleNamespace(kernel=object())        # what ipykernel's shell carries
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    assert is_interactive(stream) is True
    bar = ProgressBar(file=stream)
    _run(bar)
    assert "Train epoch 1" in stream.getvalue()
    # a terminal IPython (no kernel) writing to a file is not
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: object()))
    assert progress_bar._in_notebook() is False and is_interactive(io.StringIO()) is False
