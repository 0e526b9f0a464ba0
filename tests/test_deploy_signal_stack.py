"""OpenVINO swaps the calling thread's signal stack (sigaltstack) when it compiles a model and
swaps it back when its Core goes, not last-in first-out: with two Cores ended in the order they
were made, the thread is left on a stack OpenVINO has unmapped. The next signal Python handles
(SIGINT, the trainer's SIGTERM handler, the SIGCHLD handler of a DataLoader with workers) then
kills the process with SIGSEGV: CI's test run died that way after the deploy tests. The engine
and the exporter put the thread's stack back after every OpenVINO call."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT

pytest.importorskip("openvino")

SCRIPT = textwrap.dedent("""
    import faulthandler, gc, os, signal, sys
    faulthandler.enable()                         # as pytest does: Python's handlers run on this stack
    sys.path.insert(0, {tests!r})
    from basetrainer.deploy.export import export_model
    from basetrainer.engine.openvino_engine import OpenVINOEngine
    from test_deploy_export import images, small_net
    out = {out!r}
    export_model(small_net(), "openvino", out_dir=out, input_size=[16, 16], check=images(4), runs=0, name="m")
    first = OpenVINOEngine(os.path.join(out, "m.xml"))
    second = OpenVINOEngine(os.path.join(out, "m.xml"))
    first(images(2)), second(images(2))
    del first; gc.collect()
    del second; gc.collect()
    got = []
    signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
    os.kill(os.getpid(), signal.SIGUSR1)          # a Python handler, delivered on the signal stack
    print("handled", got)
""")


@pytest.mark.distributed   # runs a process (a crash must not take the test run with it)
def test_engines_leave_the_signal_stack_usable(tmp_path):
    script = tmp_path / "ov.py"
    script.write_text(SCRIPT.format(tests=os.path.join(ROOT, "tests"), out=str(tmp_path / "out")))
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "handled [1]" in done.stdout
