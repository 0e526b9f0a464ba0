"""The promises checked on every generated config (:mod:`combos`), and the runs they need.

Invariants, each failure named by its number:

1. **equals one process**: the final weights, the EMA average, every logged figure and
   ``predict()`` equal the one-process run of the same config (fp32 within :data:`FP32`; bf16
   autocast within :data:`BF16`, see there). Not with dropout: each rank draws the masks of its
   share of the batch from its own generator (no promise covers it; the others hold);
2. **resume equals uninterrupted**: SIGKILL mid-epoch, then ``resume: auto``, ends with the
   uninterrupted run's weights, EMA and history (same world size: within :data:`RESUMED`);
3. **weights files reproduce their names**: every ``best_model_<e>_<v>.pth`` / ``model_<e>_<v>.pth``,
   evaluated in one process, gives ``v`` (to the 4 decimals of the name);
4. **evaluate() and predict()**: ``evaluate()`` after the run returns the last epoch's test
   figures; ``predict()`` returns one process's outputs in dataset order (invariant 1's bound);
5. **export**: the newest checkpoint exports to ONNX and agrees with eager under the export's
   parity rule.

A refused config (:data:`combos.REFUSED`) must be refused on every rank, the message naming the key.
"""
import math
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from combos import HERE, ROOT, SIZES, STACKS_AFTER_S, Combo, ComboData, ComboTrainer, config_of, train

#: fp32: DDP/FSDP and one process differ only in the order of the gradient sums
FP32 = 1e-5
#: bf16 autocast rounds each matmul's inputs and outputs to 8 significant bits (one step is 2**-8
#: to 2**-7 of a value), and how a batch is split over the ranks decides which products are
#: rounded together, so the fp32 bound cannot hold. Weights, losses and outputs are held to two
#: bf16 steps of their largest value (at least 1). Measured on this suite (2026-11-27, seed 0,
#: 2 epochs, lr 0.05, momentum 0.9): weights within 9.8e-4, losses 5e-4, outputs one bf16 step
#: (0.031 at logits near 8). Every level of every factor also meets fp32 in some config (the set
#: is pairwise), where the bound is FP32: that is where a wrong sum shows.
BF16 = 2.0 ** -6
#: an accuracy is a count: under bf16 a sample whose two best scores lie closer than the
#: rounding flips, so a bf16 accuracy may differ by this many samples
BF16_FLIPS = 2
RESUMED = 1e-6
NAMED = re.compile(r"^(?:best_model|model)_(\d{3})_(-?\d+\.\d{4})\.pth$")


def tolerance(combo: Combo) -> float:
    return BF16 if combo.precision == "bf16" else FP32


def _scaled(a: Any, b: Any, combo: Combo) -> float:
    """``_diff(a, b)`` in units of the bound: <= 1 passes (fp32: absolute; bf16: relative to the
    size of ``a``, at least 1)."""
    d = _diff(a, b)
    if combo.precision != "bf16":
        return d / FP32
    return d / (BF16 * max(1.0, _magnitude(a)))


def _magnitude(a: Any) -> float:
    if isinstance(a, dict):
        return max([_magnitude(v) for v in a.values()] or [0.0])
    if isinstance(a, (list, tuple)):
        return max([_magnitude(v) for v in a] or [0.0])
    if isinstance(a, torch.Tensor):
        return float(a.double().abs().max()) if a.numel() else 0.0
    return abs(float(a)) if isinstance(a, (int, float)) else 0.0


def _figures_close(a: Dict[str, float], b: Dict[str, float], combo: Combo) -> Optional[str]:
    """None when one epoch's logged figures agree within the bound, else what differs (an
    accuracy under bf16: at most BF16_FLIPS samples of its phase)."""
    for key, x in a.items():
        if key == "epoch" or key.endswith("_time"):
            continue
        y = b.get(key, math.nan)
        if "Accuracy" in key and combo.precision == "bf16":
            n = SIZES[combo.data, "train" if key.startswith("train/") else "test"]
            ok = abs(x - y) <= BF16_FLIPS / n + 1e-9
        else:
            ok = _scaled(x, y, combo) <= 1.0
        if not ok:
            return f"{key}: {x!r} vs {y!r}"
    return None


# ---------------------------------------------------------------------------------- runs
def job(combos: Sequence[Combo], root: str, stage: str, seed: int, timeout: float = 300) -> subprocess.CompletedProcess:
    """``combos`` (one world size) as one launch()ed job: each rank runs them one after the other."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, os.path.join(HERE, "combos.py"), "--seed", str(seed), "--root", root, "--stage", stage,
           "--ranks", ",".join(c.cid for c in combos)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:   # a hang fails its configs (the job's whole group is killed), not the suite
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n{stage} of {','.join(c.cid for c in combos)} hung: killed after {timeout:.0f} s"
        return subprocess.CompletedProcess(cmd, -signal.SIGKILL, out, err)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def result_of(root: str, combo: Combo, stage: str, rank: int = 0) -> Optional[Dict[str, Any]]:
    path = os.path.join(root, combo.cid, f"{stage}-rank{rank}.pt")
    return torch.load(path, weights_only=False) if os.path.isfile(path) else None


def ranks_report(root: str, combo: Combo, stage: str) -> str:
    """What each rank of ``combo``'s job left: its error, and its stacks if it ran past
    combos.STACKS_AFTER_S (a rank that hung is often not the one whose error comes first)."""
    parts = []
    for rank in range(combo.world):
        result = result_of(root, combo, stage, rank)
        if result is not None and "error" in result:
            parts.append(f"rank {rank} failed:\n{result['error'][-2000:]}")
        path = os.path.join(root, combo.cid, f"{stage}-rank{rank}.stacks.txt")
        if os.path.isfile(path) and os.path.getsize(path):
            with open(path) as f:
                parts.append(f"rank {rank} was still running after {STACKS_AFTER_S} s:\n{f.read()[-4000:]}")
    return "\n".join(parts)


def run_group(combos: Sequence[Combo], root: str, seed: int) -> Dict[str, str]:
    """Run ``combos`` (one world size) as few jobs as failures allow: a config that fails ends
    its job, is recorded, and the job is started again with the configs after it."""
    errors: Dict[str, str] = {}
    todo = list(combos)
    while todo:
        done = job(todo, root, "run", seed)
        left = []
        for i, combo in enumerate(todo):
            result = result_of(root, combo, "run")
            if result is None:
                if done.returncode == 0:
                    errors[combo.cid] = f"job ended 0 without a result:\n{done.stderr[-3000:]}"
                else:
                    left = todo[i:]
                break
            if "error" in result:
                errors[combo.cid] = f"{result['error']}\n{ranks_report(root, combo, 'run')}"
                left = todo[i + 1:]
                break
        else:
            left = []
        if left and left[0].cid not in errors and result_of(root, left[0], "run") is None and done.returncode != 0:
            errors[left[0].cid] = (f"job failed (exit {done.returncode}) before a result:\n{done.stderr[-3000:]}\n"
                                   f"{ranks_report(root, left[0], 'run')}")
            left = left[1:]
        todo = left
    return errors


def run_killed(combo: Combo, root: str, seed: int) -> Optional[str]:
    """SIGKILL mid-epoch (rank 0, after step KILL_AT), then ``resume: auto``: None, or what went wrong."""
    killed = job([combo], root, "kill", seed)
    if killed.returncode == 0 or result_of(root, combo, "kill") is not None:
        return f"the run to kill was not killed (exit {killed.returncode}):\n{killed.stderr[-3000:]}"
    resumed = job([combo], root, "resume", seed)
    if resumed.returncode != 0:
        return f"resume: auto after SIGKILL failed (exit {resumed.returncode}):\n{resumed.stderr[-3000:]}"
    return None


def run_all(combos: Sequence[Combo], root: str, seed: int) -> Dict[str, Any]:
    """Every run the invariants need: the one-process references (in this process), the
    multi-process configs grouped by world size, the kills and resumes. Returns timings and
    errors by config.

    The jobs run two at a time beside the references: a job spends seconds starting its
    processes (each imports torch) and connecting them, which the others' training fills
    (measured on 2 cores: the runs took 278 s one after the other, 246 s so)."""
    times: Dict[str, float] = {}
    errors: Dict[str, str] = {}
    for combo in combos:
        if not combo.refusal():
            os.makedirs(os.path.join(root, combo.cid), exist_ok=True)

    def timed(name: str, work: Any) -> Dict[str, str]:
        begin = time.perf_counter()
        found = work()
        times[name] = time.perf_counter() - begin
        return found

    def group(world: int) -> Dict[str, str]:
        return run_group([c for c in combos if c.world == world], root, seed)

    def killed(combo: Combo) -> Dict[str, str]:
        problem = run_killed(combo, root, seed)
        return {combo.cid: problem} if problem else {}

    jobs = [(f"world {w}", lambda w=w: group(w)) for w in sorted({c.world for c in combos if c.world > 1})]
    jobs += [(f"kill and resume {c.cid}", lambda c=c: killed(c)) for c in combos if c.resume == "kill"]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2) as pool:
        running = [pool.submit(timed, name, work) for name, work in jobs]
        begin = time.perf_counter()
        for combo in combos:
            if combo.refusal():
                continue
            try:
                torch.save(train(combo.reference(), os.path.join(root, combo.cid, "ref")),
                           os.path.join(root, combo.cid, "ref-rank0.pt"))
            except Exception:
                import traceback

                errors[combo.cid] = "the one-process reference failed:\n" + traceback.format_exc()
        times["references"] = time.perf_counter() - begin
        for future in running:
            for cid, problem in future.result().items():
                errors.setdefault(cid, problem)
    times["all"] = time.perf_counter() - start
    return {"times": times, "errors": errors}


# ---------------------------------------------------------------------------------- invariants
def _diff(a: Any, b: Any) -> float:
    """The largest absolute difference of two nested structures of tensors (inf on a mismatch)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return math.inf
        return max([_diff(a[k], b[k]) for k in a] or [0.0])
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return math.inf
        return max([_diff(x, y) for x, y in zip(a, b)] or [0.0])
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            return math.inf
        if not a.numel():
            return 0.0
        d = float((a.double() - b.double()).abs().max())
        return math.inf if d != d else d
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(float(a) - float(b))
    return 0.0 if a == b else math.inf


def _history_diff(a: List[Dict[str, float]], b: List[Dict[str, float]]) -> float:
    keys = [{k for k in e if k != "epoch_time" and not k.endswith("_time")} for e in a]
    return _diff([{k: e[k] for k in ks} for e, ks in zip(a, keys)],
                 [{k: e.get(k, math.nan) for k in ks} for e, ks in zip(b, keys)]) if len(a) == len(b) else math.inf


def _indicator(combo: Combo) -> str:
    return "test/loss" if combo.callbacks == "minimal" else "test/Accuracy"


def check_files(combo: Combo, work: str, scratch: str) -> List[str]:
    """Invariant 3: every weights file, evaluated in one process, gives the figure in its name."""
    model_dir = os.path.join(work, "model")
    named = [f for f in sorted(os.listdir(model_dir)) if NAMED.match(f)] if os.path.isdir(model_dir) else []
    if not named:
        return [f"3 (weights files): no best_model_*/model_* file in {model_dir}"]
    found = []
    plain = Combo(**{**combo.reference().levels(), "ema": False, "resume": "none", "workers": 0}, cid=combo.cid)
    for name in named:
        trainer = ComboTrainer(config_of(plain, os.path.join(scratch, name)), plain, callbacks="none")
        figures = trainer.evaluate(checkpoint=os.path.join(model_dir, name))
        value, got = float(NAMED.match(name).group(2)), float(figures[_indicator(combo)])
        name_close = abs(got - value) <= 5e-5 + 1e-6   # the name's 4 decimals
        if not (name_close or (combo.precision == "bf16" and _figures_close({_indicator(combo): value},
                                                                              {_indicator(combo): got}, combo) is None)):
            found.append(f"3 (weights files): {name} evaluates to {_indicator(combo)} {got:.6f}, its name says {value}")
    return found


def check_export(combo: Combo, work: str, scratch: str) -> List[str]:
    """Invariant 5: the newest checkpoint exports to ONNX and agrees with eager."""
    from basetrainer.deploy.export import export_model

    plain = Combo(**{**combo.reference().levels(), "ema": False, "resume": "none", "workers": 0}, cid=combo.cid)
    trainer = ComboTrainer(config_of(plain, os.path.join(scratch, "export-src")), plain, callbacks="none")
    trainer.evaluate(checkpoint=os.path.join(work, "model", "last.pth"))
    inputs = ComboData(plain, "test").x.numpy()
    try:
        export_model(trainer.unwrapped_model, "onnx", out_dir=os.path.join(scratch, "export"),
                     input_size=list(inputs.shape[2:][::-1]) if inputs.ndim == 4 else None, check=inputs, runs=0,
                     report_files=False, output_names=("logits", "value") if combo.model == "twoout" else ("output",))
    except Exception as e:
        return [f"5 (export): {type(e).__name__}: {str(e)[:1500]}"]
    return []


def check(combo: Combo, root: str, errors: Dict[str, str]) -> Tuple[List[str], Dict[str, float]]:
    """Every invariant on ``combo``'s runs under ``root`` (made by :func:`run_all`): the failures,
    and the measured differences."""
    folder = os.path.join(root, combo.cid)
    if combo.cid in errors:   # every invariant needs the run: its error first, then the whole output
        raised = re.findall(r"^(?:[\w.]+\.)?\w+(?:Error|Exception|Exit)\b.*$", errors[combo.cid], re.M)
        return [f"the run failed ({raised[0].strip() if raised else 'see its output'}):\n{errors[combo.cid]}"], {}
    if combo.refusal():
        messages = [result_of(root, combo, "run", r) for r in range(combo.world)]
        word = combo.refusal()
        bad = [m for m in messages if not m or not m.get("refused") or word not in m["refused"]]
        return ([f"refusal: {combo.describe()} must be refused on every rank naming {word!r}; got {messages}"]
                if bad else []), {}
    ref = result_of(root, combo, "ref")
    run = ref if combo.world == 1 else result_of(root, combo, "run")
    tol, failures, measured = tolerance(combo), [], {}
    # 1: equals one process
    if combo.world > 1 and not combo.dropout:
        for name in ("weights", "ema", "predict"):
            measured[name] = d = _diff(ref[name], run[name]) if ref[name] is not None else 0.0
            if ref[name] is not None and not _scaled(ref[name], run[name], combo) <= 1.0:
                failures.append(f"1 (equals one process): {name} differ by {d:.3g} (bound {tol:g}"
                                f"{' x their size' if combo.precision == 'bf16' else ''})")
        measured["history"] = _history_diff(ref["history"], run["history"])
        wrong = ([_figures_close(a, b, combo) for a, b in zip(ref["history"], run["history"])]
                 if len(ref["history"]) == len(run["history"]) else ["the number of epochs"])
        if any(wrong):
            failures.append(f"1 (equals one process): logged figures differ ({next(w for w in wrong if w)}):\n"
                            f"  one process {ref['history']}\n  {combo.strategy} {run['history']}")
        for r in range(1, combo.world):   # every rank ends with the same figures
            other = result_of(root, combo, "run", r)
            if _history_diff(run["history"], other["history"]) > 0:
                failures.append(f"1 (equals one process): rank {r}'s figures differ from rank 0's")
    # 2: resume equals uninterrupted
    if combo.resume == "kill":
        resumed = result_of(root, combo, "resume")
        for name in ("weights", "ema"):
            measured[f"resumed {name}"] = d = _diff(run[name], resumed[name]) if run[name] is not None else 0.0
            if not d <= RESUMED:
                failures.append(f"2 (resume equals uninterrupted): {name} differ by {d:.3g} > {RESUMED:g}")
        tail = run["history"][-len(resumed["history"]):]
        measured["resumed history"] = d = _history_diff(tail, resumed["history"])
        if not d <= RESUMED:
            failures.append(f"2 (resume equals uninterrupted): figures differ by {d:.3g}:\n"
                            f"  uninterrupted {tail}\n  resumed {resumed['history']}")
    # 4: evaluate() returns the last test figures
    last = {k: v for k, v in run["history"][-1].items() if k.startswith("test/")}
    measured["evaluate"] = d = _diff(last, {k: run["evaluate"].get(k, math.nan) for k in last}) if last else math.inf
    if not d <= 1e-6:
        failures.append(f"4 (evaluate): evaluate() gave {run['evaluate']}, the run's last test figures {last}")
    # 3 and 5: the files
    work = os.path.join(folder, "ref" if combo.world == 1 else "run")
    scratch = os.path.join(folder, "scratch")
    failures += check_files(combo, work, scratch)
    failures += check_export(combo, work, scratch)
    return failures, measured


def check_one(combo: Combo, root: str, seed: int = 0) -> List[str]:
    """All runs and invariants of one config (the rerun command)."""
    state = run_all([combo], root, seed)
    return check(combo, root, state["errors"])[0]
