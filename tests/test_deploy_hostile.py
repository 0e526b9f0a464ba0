"""An export attacked: killed mid-conversion, run again into the same folder, out of disk space."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT

PY = sys.executable

SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from basetrainer.deploy import converters
    from basetrainer.deploy.export import export_model
    from test_deploy_export import images, small_net
    if {tool!r}:
        converters.pnnx_binary = lambda: {tool!r}
    report = export_model(small_net(), {formats!r}, out_dir={out!r}, input_size=[16, 16], check=images(8), runs=0,
                          name="m", strict=False)
    print([(r.format, r.status) for r in report.rows[1:]])
""")


def _script(tmp_path, out, formats, tool=""):
    path = tmp_path / "export.py"
    path.write_text(SCRIPT.format(tests=os.path.join(ROOT, "tests"), tool=tool, formats=formats, out=str(out)))
    return str(path)


@pytest.mark.distributed   # starts processes
def test_killed_mid_conversion_then_run_again(tmp_path):
    out = tmp_path / "out"
    started = tmp_path / "pnnx-started"
    tool = tmp_path / "slow-pnnx.sh"
    tool.write_text(f"#!/bin/sh\ntouch {started}\nsleep 60\n")
    tool.chmod(0o755)
    proc = subprocess.Popen([PY, _script(tmp_path, out, "onnx,ncnn", str(tool))], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not started.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert started.exists(), proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "no start"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    left = sorted(os.listdir(out))
    # onnx was done (checked, then moved into place); ncnn was not: nothing of it at its final paths
    assert len(left) == 2 and left[0].startswith(".export-tmp-") and left[1] == "m.onnx", left
    # run again into the same folder: the stale staging folder goes, the files land
    again = subprocess.run([PY, _script(tmp_path, out, "onnx,ncnn")], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[('onnx', 'ok'), ('ncnn', 'ok')]" in again.stdout
    assert sorted(os.listdir(out)) == ["m.export.json", "m.export.md", "m.ncnn.bin", "m.ncnn.param", "m.onnx"]


def _tmpfs_reason():
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs in a private mount namespace"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt && umount /mnt"],
                           capture_output=True, text=True)
    return None if probe.returncode == 0 else f"cannot mount a tmpfs here: {probe.stderr.strip()}"


@pytest.mark.distributed   # starts processes
def test_disk_full_leaves_nothing_at_the_final_path(tmp_path):
    reason = _tmpfs_reason()
    if reason:
        pytest.skip(reason)
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "full.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        from basetrainer.deploy.export import export_model
        from basetrainer.models.build_models import get_models
        out = sys.argv[1]
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, "m.onnx"), "wb").write(b"the older export")
        try:   # resnet18's ONNX file is 45 MB; the disk holds 2 MB
            export_model(get_models("resnet18", [16, 16], 4), "onnx", out_dir=out, input_size=[16, 16], runs=0,
                         name="m", report_files=False)
        except Exception as e:
            print("ERROR", type(e).__name__, e)
        print(sorted(os.listdir(out)), open(os.path.join(out, "m.onnx"), "rb").read())
    """))
    proc = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=2m tmpfs {disk} && "
                           f"exec {PY} {script} {disk}/out"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR ExportFailed export failed for onnx: error: DiskFullError: [Errno 28] no space left in" in proc.stdout
    assert "free space or pass another out_dir" in proc.stdout
    assert proc.stdout.strip().endswith("['m.onnx'] b'the older export'")     # no staging left, old file intact
