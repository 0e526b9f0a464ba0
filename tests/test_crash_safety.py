"""No crash loses work: SIGKILL at every file-write boundary, then ``resume: auto``, must end
exactly where an uninterrupted run ends (weights, best model, per-epoch files, history.csv,
TensorBoard, the train log), with no temp file left behind.

The kills are deterministic: tests/crash_harness.py counts write events (temp file opened,
fsync, before/after rename, link, remove) and SIGKILLs itself at the chosen one.
"""
import csv
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, weight_diff

PY = sys.executable
HARNESS = os.path.join(ROOT, "tests", "crash_harness.py")
VALUES = [0.5, 0.3, 0.4, 0.45]       # the scripted test/metric (mode min): best at epoch 1


def harness(cases, folder, name):
    spec = os.path.join(str(folder), f"{name}.json")
    with open(spec, "w") as f:
        json.dump(cases, f)
    out = subprocess.run([PY, HARNESS, spec], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs (background and foreground writes), with their write events."""
    root = tmp_path_factory.mktemp("crash_ref")
    cases = [{"work": str(root / f"ref{int(a)}"), "values": VALUES, "async_save": a,
              "events": str(root / f"events{int(a)}.txt")} for a in (False, True)]
    codes, _ = harness(cases, root, "ref")
    assert codes == [0, 0]
    refs = {}
    for a in (False, True):
        with open(root / f"events{int(a)}.txt") as f:
            events = [line.split() for line in f]
        refs[a] = {"work": str(root / f"ref{int(a)}"), "events": events}
    return refs


def pth_files(work):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(work, "model", "*.pth")))


def temp_files(work):
    found = []
    for folder, _, files in os.walk(work):
        found += [os.path.join(folder, f) for f in files if f.startswith(".") and ".tmp" in f]
    return found


def history(work):
    with open(os.path.join(work, "log", "history.csv"), newline="") as f:
        return [{k: v for k, v in row.items() if k != "epoch_time"} for row in csv.DictReader(f)]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def compare_to_reference(work, ref):
    """Every way the resumed run may differ from the uninterrupted one, as a list of strings."""
    problems = []
    if not os.path.exists(os.path.join(work, "final.pt")):
        return ["the resumed run wrote no final weights"]
    final, reference = load(os.path.join(work, "final.pt"))["model"], load(os.path.join(ref, "final.pt"))["model"]
    if not weight_diff(final, reference) <= 1e-6:
        problems.append("final weights differ")
    if pth_files(work) != pth_files(ref):
        problems.append(f"files {pth_files(work)} != {pth_files(ref)}")
    for name in pth_files(ref):
        if name.startswith(("best_model", "model_")) and name in pth_files(work):
            if not weight_diff(load(os.path.join(work, "model", name)), load(os.path.join(ref, "model", name))) <= 1e-6:
                problems.append(f"{name} holds other weights")
    if temp_files(work):
        problems.append(f"temp files left: {temp_files(work)}")
    rows, ref_rows = history(work), history(ref)
    if [r["epoch"] for r in rows] != [r["epoch"] for r in ref_rows]:
        problems.append(f"history.csv epochs {[r['epoch'] for r in rows]}")
    elif any(abs(float(a["train/loss"]) - float(b["train/loss"])) > 1e-6 for a, b in zip(rows, ref_rows)):
        problems.append("history.csv train/loss differs")
    return problems


def kill_and_resume(tmp_path, reference, background, indices):
    ref = reference[background]
    kills = [{"work": str(tmp_path / f"k{k}"), "values": VALUES, "async_save": background, "kill_at": k}
             for k in indices]
    codes, _ = harness(kills, tmp_path, "kill")
    resumes = [dict(case, kill_at=-1, resume="auto") for case in kills]
    resume_codes, stderr = harness(resumes, tmp_path, "resume")
    failures = {}
    for k, code, case, rcode in zip(indices, codes, kills, resume_codes):
        event = " ".join(ref["events"][k][1:])
        if code != -9:
            failures[k] = [f"not killed at event {k} ({event}): exit {code}"]
            continue
        if rcode != 0:
            failures[k] = [f"resume exited {rcode}"]
            continue
        problems = compare_to_reference(case["work"], ref["work"])
        if problems:
            failures[k] = [f"event {k} ({event})"] + problems
    return failures, stderr


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_at_every_write_boundary_resumes_to_the_uninterrupted_result(tmp_path, reference):
    # foreground writes: the event sequence is the same every run, so index k is one boundary
    events = reference[False]["events"]
    failures, stderr = kill_and_resume(tmp_path, reference, False, list(range(len(events))))
    assert not failures, "\n".join("; ".join(v) for v in failures.values()) + "\n" + stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_during_background_writes_resumes_to_the_uninterrupted_result(tmp_path, reference):
    # background writes: events of the writer thread interleave with the loop's, so sample them
    events = reference[True]["events"]
    failures, stderr = kill_and_resume(tmp_path, reference, True, list(range(0, len(events), 3)))
    assert not failures, "\n".join("; ".join(v) for v in failures.values()) + "\n" + stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_best_model_survives_a_kill_between_the_best_file_and_last_pth(tmp_path, reference):
    """The reported defect: last.pth recorded the new best before the best file existed."""
    events = reference[False]["events"]
    # every boundary of epoch 1's save (the epoch that becomes best): from the first event
    # after epoch 0's last.pth to the one writing epoch 1's last.pth
    last_done = [i for i, e in enumerate(events) if e[1] == "replaced" and e[2] == "last.pth"]
    window = list(range(last_done[0] + 1, last_done[1] + 1))
    failures, stderr = kill_and_resume(tmp_path, reference, False, window)
    assert not failures, "\n".join("; ".join(v) for v in failures.values())
    for k in window:
        best = glob.glob(str(tmp_path / f"k{k}" / "model" / "best_model_*.pth"))
        assert [os.path.basename(p) for p in best] == ["best_model_001_0.3000.pth"], k


@pytest.mark.distributed
@pytest.mark.slow
def test_history_tensorboard_and_log_continue_across_a_resume(tmp_path, reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = reference[False]["events"]
    # killed in the middle of epoch 2's save: epochs 0 and 1 are in last.pth
    last_done = [i for i, e in enumerate(events) if e[1] == "replaced" and e[2] == "last.pth"]
    k = last_done[1] + 2
    failures, _ = kill_and_resume(tmp_path, reference, False, [k])
    assert not failures, failures
    work, ref = str(tmp_path / f"k{k}"), reference[False]["work"]
    assert [r["epoch"] for r in history(work)] == ["0", "1", "2", "3"]
    assert os.path.getsize(os.path.join(work, "log", "history.png")) > 0
    with open(os.path.join(work, "log", "train.log")) as f:
        text = f.read()
    for epoch in range(4):   # the log of the killed run goes on in the resumed one
        assert f"epoch {epoch}/4 done" in text, epoch
    assert "resumed at epoch 2, step 0" in text       # and says where the redone part starts

    def scalars(folder):
        acc = EventAccumulator(folder)
        acc.Reload()
        return {tag: [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

    got, want = scalars(os.path.join(work, "log")), scalars(os.path.join(ref, "log"))
    for tag in ("train/loss", "test/metric", "lr"):
        if tag in want:
            assert got[tag] == want[tag], tag     # every epoch exactly once, same values
