"""Start a training function in one process, or in one process per device (DDP).

``launch`` decides how: not distributed -> a plain call; started by torchrun or inside a SLURM
job with several tasks -> this process joins that world; otherwise it spawns
``num_gpus_per_machine`` processes on this machine (NCCL on GPUs, gloo on the CPU).
"""
import argparse
import datetime
import functools
import gc
import logging
import multiprocessing
import os
import pickle
import shutil
import socket
import subprocess
import tempfile
import traceback
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from basetrainer.engine.spawn import spawn
from basetrainer.runtime import watchdog
from basetrainer.runtime.errors import EXIT_USAGE, ConfigError, UsageError

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
RESULT = "result.pkl"   # the first spawned rank's result, for the launching process


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_busy(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _resolve_url(dist_url: Optional[str], num_machines: int) -> str:
    if not dist_url or dist_url == "auto":
        if num_machines > 1:
            raise ConfigError("dist_url='auto' only works on one machine; with num_machines > 1 give "
                             "tcp://<address of machine 0>:<port>, the same on every machine")
        return f"tcp://127.0.0.1:{find_free_port()}"
    parsed = urlparse(dist_url)
    if parsed.scheme != "tcp" or not parsed.hostname or not parsed.port:
        raise ConfigError(f"dist_url={dist_url!r} must look like tcp://127.0.0.1:28661 (or be 'auto')")
    if num_machines == 1 and _port_busy(parsed.hostname, parsed.port):
        port = find_free_port(parsed.hostname)
        logger.warning("dist_url %s: port %d is busy; using free port %d instead", dist_url, parsed.port, port)
        return f"tcp://{parsed.hostname}:{port}"
    return dist_url


def _stall_timeout(args: Sequence) -> float:
    """The ``stall_timeout`` of the config among ``args`` (the first mapping or argparse
    namespace that has the key; a number written as a string counts, as the trainer reads it),
    else its default."""
    for arg in args:
        if isinstance(arg, Mapping) and "stall_timeout" in arg:
            value = arg["stall_timeout"]
        elif isinstance(arg, argparse.Namespace) and hasattr(arg, "stall_timeout"):
            value = arg.stall_timeout
        else:
            continue
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass   # refused below, naming the key
        return watchdog.check_timeout(value)
    return watchdog.DEFAULT_STALL_TIMEOUT


def _timeout(timeout: Any, args: Sequence = ()) -> datetime.timedelta:
    """The process group's timeout: ``timeout``, or (None) ``stall_timeout`` + 60 s, so that the
    stall watchdog reports a stuck collective before the backend fails it without naming a rank."""
    stall = _stall_timeout(args)
    if timeout is None:
        seconds = watchdog.group_timeout(stall)
        return datetime.timedelta(seconds=seconds) if seconds else DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        result = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        result = datetime.timedelta(seconds=float(timeout))
    else:
        raise ConfigError(f"timeout={timeout!r} must be a positive number of seconds or a timedelta (or None: "
                          f"stall_timeout + {watchdog.GROUP_MARGIN:g} s)")
    if stall and result.total_seconds() < stall + watchdog.GROUP_MARGIN:
        logger.warning("launch: timeout=%gs is shorter than stall_timeout (%gs) + %gs: a stuck collective fails "
                       "with the backend's message, which names no rank, before the stall report; leave timeout "
                       "unset (None) to follow stall_timeout", result.total_seconds(), stall, watchdog.GROUP_MARGIN)
    return result


def _pick_backend(backend: Optional[str], nprocs: int) -> str:
    if backend:
        return backend
    if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs:
        return "nccl"
    if not torch.cuda.is_available():
        logger.warning("no CUDA device: %d process(es) per machine will train on the CPU over gloo", nprocs)
    else:
        logger.warning("%d processes but only %d CUDA devices: using gloo", nprocs, torch.cuda.device_count())
    return "gloo"


def _slurm_master_addr() -> str:
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if nodelist:
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, check=True, timeout=30).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass
    raise ConfigError("inside SLURM with several tasks, but the address of the first node is unknown (no "
                      "MASTER_ADDR, and scontrol did not name the nodes): export MASTER_ADDR (e.g. "
                      "MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1))")


def _slurm_tasks() -> int:
    """The tasks of the srun step this process is one of (1 when not under srun with several)."""
    try:
        return int(os.environ.get("SLURM_NTASKS", "1")) if "SLURM_PROCID" in os.environ else 1
    except ValueError:
        return 1


def _in_srun_step() -> bool:
    """A task srun started: its step has a number in SLURM_STEP_ID. ``sbatch -n 2`` also runs its
    script with SLURM_NTASKS=2 and SLURM_PROCID=0, once, outside any srun step: a one-process run
    there is the user's choice, not a task left alone (not checked on a real cluster)."""
    step = os.environ.get("SLURM_STEP_ID", os.environ.get("SLURM_STEPID", ""))
    return step.isdigit() and step != "4294967294"   # Slurm's number for the batch script's step


def _let_ddp_free_its_group() -> None:
    """Import ``torch.distributed.nn`` before any DDP model is built.

    Measured on torch 2.14.1 (gloo, CPU): a DDP model built before ``torch.distributed.nn`` (its
    RemoteModule) was ever imported keeps 10 references to its process group alive in C++ after
    the model is freed, so ``destroy_process_group()`` in :func:`_leave_group` cannot join gloo's
    threads; imported before the model is built (here: before the group is made), the group goes.
    Why is torch's; the sync BatchNorm module imported it by chance until it stopped using
    ``torch.distributed.nn.functional``. tests/test_distributed.py (the test of the group's threads
    at exit) guards it.
    """
    import torch.distributed.nn  # noqa: F401


def _elastic_store(world_size: int, rank: int, timeout: datetime.timedelta) -> Any:
    """torchrun's store, with keys of their own for each restart of the group.

    Measured on torch 2.14.1 (gloo): after ``--max-restarts`` restarts the group, ``env://``
    finds the previous attempt's gloo addresses in the agent's store (it keeps serving it) and
    the new ranks connect to dead ones ("Gloo connectFullMesh failed ... Connection refused");
    a prefix per ``TORCHELASTIC_RESTART_COUNT`` gives every attempt a clean namespace.
    """
    env = os.environ
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"   # the agent serves the store
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size,
                          is_master=not agent and rank == 0, timeout=timeout)
    return dist.PrefixStore(f"basetrainer/attempt_{env['TORCHELASTIC_RESTART_COUNT']}", store)


def _run_in_group(main_func: Callable, args: Tuple, backend: str, init_method: str, world_size: int,
                  rank: int, local_rank: int, timeout: datetime.timedelta,
                  deliver: Optional[Callable[[Any], None]] = None) -> Any:
    _let_ddp_free_its_group()
    if backend == "nccl":
        torch.cuda.set_device(local_rank)  # before any collective
    if init_method == "env://" and "TORCHELASTIC_RESTART_COUNT" in os.environ:
        dist.init_process_group(backend=backend, store=_elastic_store(world_size, rank, timeout),
                                world_size=world_size, rank=rank, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, init_method=init_method, world_size=world_size, rank=rank,
                                timeout=timeout)
    try:
        result = main_func(*args)
        if deliver is not None:   # a spawned rank: the result goes to the launching process (or nowhere)
            deliver(result)
            result = None  # a returned trainer would keep its DDP model, and so the group, alive
        dist.barrier()  # leave together: gloo may abort a rank that tears down while peers still work
        return result
    finally:
        _leave_group()


def _leave_group() -> None:
    """Destroy the process group now, while the interpreter is whole.

    A DDP model holds a reference to the group, and a trainer lives on in a reference cycle with
    its callbacks after ``main_func`` returns. ``destroy_process_group()`` alone then leaves the
    group, and gloo's worker threads, alive into interpreter shutdown; a worker that still has to
    free a tensor there aborts the process ("terminate called without an active exception",
    SIGABRT) after training succeeded. Collecting the cycles first lets the group's last
    reference go here, which joins its threads.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _send_result(path: str, result: Any) -> None:
    """Pickle ``result`` to ``path`` for the launching process (a warning when it can't be)."""
    try:
        data = pickle.dumps(result)
    except Exception as e:   # a trainer, a model, a lambda: anything pickle refuses
        logger.warning("launch: main_func returned a %s, which can't be sent back to the launching process (%s): "
                       "launch() returns None there; return figures (a History, a dict) rather than objects that "
                       "hold the model", type(result).__name__, e)
        return
    with open(path, "wb") as f:
        f.write(data)


def _send_usage_error(outbox: str, rank: int, error: BaseException) -> None:
    """Leave a rank's user error (with its traceback as a note) for the launching process, which
    raises it once (the ranks print nothing)."""
    error.add_note(f"(raised in rank {rank}; its traceback:)\n{traceback.format_exc().rstrip()}")
    try:
        data = pickle.dumps(error)
    except Exception:   # e.g. an attribute pickle refuses: the message is what counts
        data = pickle.dumps(UsageError(str(error)))
    with open(os.path.join(outbox, f"usage_error.{rank}.pkl"), "wb") as f:
        f.write(data)


def _received(outbox: str, name: str) -> Tuple[bool, Any]:
    """``(True, object)`` from ``outbox/name`` when a rank left it there, else ``(False, None)``."""
    path = os.path.join(outbox, name)
    if not os.path.isfile(path):
        return False, None
    with open(path, "rb") as f:
        return True, pickle.load(f)


def _raise_usage_error(outbox: str, world_size: int) -> None:
    """Raise the user error a rank (the lowest) left in ``outbox``, if any."""
    for rank in range(world_size):
        found, error = _received(outbox, f"usage_error.{rank}.pkl")
        if found:
            raise error from None   # the rank's traceback is its note; the spawn's failure says nothing more


def _worker(local_rank: int, main_func: Callable, args: Tuple, world_size: int, nprocs: int,
            machine_rank: int, backend: str, dist_url: str, timeout: datetime.timedelta,
            children: Optional[str] = None, outbox: Optional[str] = None) -> None:
    rank = machine_rank * nprocs + local_rank
    if children:   # the launcher's start method (its platform's default unless it set one)
        multiprocessing.set_start_method(children, force=True)
    if backend == "gloo" and not torch.cuda.is_available():  # CPU training: share the cores, don't oversubscribe
        torch.set_num_threads(max(1, (os.cpu_count() or nprocs) // nprocs))
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
                       "LOCAL_WORLD_SIZE": str(nprocs), "GROUP_RANK": str(machine_rank)})
    deliver = functools.partial(_send_result, os.path.join(outbox, RESULT)) if outbox and local_rank == 0 else \
        (lambda result: None)
    try:
        _run_in_group(main_func, args, backend, dist_url, world_size, rank, local_rank, timeout, deliver=deliver)
    except UsageError as e:
        if not outbox:
            raise
        _send_usage_error(outbox, rank, e)
        raise SystemExit(EXIT_USAGE) from None


def launch(main_func: Callable, num_gpus_per_machine: int = 1, dist_url: Optional[str] = "auto",
           num_machines: int = 1, machine_rank: int = 0, distributed: bool = False, args: Sequence = (),
           timeout: Any = None, backend: Optional[str] = None) -> Any:
    """Run ``main_func(*args)`` in the right processes.

    Args:
        main_func: the training function; must be picklable (defined at module top level) when
            processes are spawned.
        num_gpus_per_machine: processes per machine (one per entry of ``gpu_id``).
        dist_url: ``tcp://<machine 0 address>:<port>``; ``"auto"`` picks a free port (one
            machine). On one machine, a busy port is replaced by a free one (with a warning).
        num_machines: machines taking part; each runs ``launch`` with its ``machine_rank``.
        machine_rank: this machine's index (0 hosts the rendezvous).
        distributed: False calls ``main_func(*args)`` directly in this process.
        args: arguments of ``main_func``.
        timeout: seconds (or a timedelta) a collective may wait before the backend fails the
            job; default (None): the config's ``stall_timeout`` (of the first mapping in
            ``args`` that has the key, else its default 1800 s) + 60 s, so that the stall
            watchdog ends a stuck job first, with a report naming the ranks
            (:mod:`basetrainer.runtime.watchdog`); 30 minutes with ``stall_timeout: 0``.
        backend: ``"nccl"`` or ``"gloo"``; default NCCL with CUDA, gloo without.

    Returns:
        What ``main_func`` returned, in the same shape whichever way it ran: its result in this
        process when it runs here (not distributed; torchrun and SLURM, where each process gets
        its own rank's result), and when ``launch`` spawned the processes, the result of the
        first one it spawned (rank 0 on machine 0), sent back by pickle. Return figures (the
        History, a dict) rather than the trainer: a result that can't be pickled back gives
        None with a warning (and a DDP model still referenced keeps the process group alive).

    Raises:
        UsageError: a user error (a config value, a path, a missing package) in a spawned rank,
            raised once here with its message (the ranks print nothing; the rank's traceback is
            a note of the exception).
        Exception: the failing rank's error (with its traceback); the other ranks are stopped.

    Example::

        launch(main, num_gpus_per_machine=len(cfg.gpu_id), dist_url="auto",
               num_machines=1, machine_rank=0, distributed=cfg.distributed, args=(cfg,))
    """
    args = tuple(args)
    if not distributed:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(f"started by torchrun with WORLD_SIZE={os.environ['WORLD_SIZE']} but distributed "
                              f"is off: pass --distributed (or set distributed: true in the config)")
        if _slurm_tasks() > 1 and _in_srun_step():   # else each task would train alone, all in one work_dir
            raise ConfigError(f"started by srun with SLURM_NTASKS={os.environ['SLURM_NTASKS']} but distributed is "
                              f"off: pass --distributed (or set distributed: true in the config), or start one "
                              f"task (srun --ntasks 1)")
        return main_func(*args)
    timeout = _timeout(timeout, args)
    if not isinstance(num_gpus_per_machine, int) or num_gpus_per_machine < 1:
        raise ConfigError(f"num_gpus_per_machine={num_gpus_per_machine!r} must be a positive integer "
                         f"(len(gpu_id))")
    if not isinstance(num_machines, int) or num_machines < 1 or not 0 <= machine_rank < num_machines:
        raise ConfigError(f"machine_rank={machine_rank!r} must be in [0, num_machines={num_machines!r})")
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "LOCAL_RANK" in env:  # torchrun
        local_rank = int(env["LOCAL_RANK"])
        backend = _pick_backend(backend, int(env.get("LOCAL_WORLD_SIZE", num_gpus_per_machine)))
        return _run_in_group(main_func, args, backend, "env://", int(env["WORLD_SIZE"]), int(env["RANK"]),
                             local_rank, timeout)
    if _slurm_tasks() > 1:  # srun, one task per device
        rank, world_size = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local_rank = int(env.get("SLURM_LOCALID", "0"))
        port = urlparse(dist_url).port if dist_url and dist_url != "auto" else None
        port = int(env.get("MASTER_PORT", port or 29500))
        address = _slurm_master_addr()
        env.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank)})
        backend = _pick_backend(backend, int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]))
        return _run_in_group(main_func, args, backend, f"tcp://{address}:{port}", world_size,
                             rank, local_rank, timeout)
    try:
        pickle.dumps((main_func, args))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(f"launch: main_func {getattr(main_func, '__name__', main_func)!r} or its args can't be "
                        f"pickled for the worker processes ({e}); define main_func at module top level "
                        f"(not a lambda, closure or nested function)") from None
    backend = _pick_backend(backend, num_gpus_per_machine)
    url = _resolve_url(dist_url, num_machines)
    world_size = num_machines * num_gpus_per_machine
    # a spawned process starts its own children by spawn too: the ranks' DataLoader workers would
    # import torch and the script again (seconds each), unlike the same script under torchrun
    children = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    outbox = tempfile.mkdtemp(prefix="basetrainer-launch-")   # the first rank's result, the ranks' user errors
    try:
        try:
            spawn(_worker, num_gpus_per_machine, (main_func, args, world_size, num_gpus_per_machine, machine_rank,
                                                  backend, url, timeout, children, outbox))
        except Exception:
            _raise_usage_error(outbox, world_size)   # one message, not one traceback per rank
            raise
        try:
            return _received(outbox, RESULT)[1]
        except Exception as e:   # pickled in the rank, but it can't be rebuilt here (e.g. it needs the group)
            logger.warning("launch: main_func's result could not be unpickled in the launching process (%s): "
                           "returning None; return figures (a History, a dict) rather than objects that hold "
                           "the model", e)
            return None
    finally:
        shutil.rmtree(outbox, ignore_errors=True)
