"""Errors in what the user gave (a config value, a path, a folder, a missing package), and how a
command shows them: one line, ``error: <message>`` on stderr, exit status 2, no traceback.

A :class:`UsageError` is raised like any other exception, so library calls from Python (and
tests) catch it as before: each kind is also the built-in type callers expect (a bad config value
is a ``ValueError``, a refused ``work_dir`` a ``FileExistsError``, a missing extra an
``ImportError``, ...). Only a command's entry point turns it into a message and an exit status::

    if __name__ == "__main__":
        with errors.exit_on_usage_error():
            cfg = parse_config()
            launch(main, ..., args=(cfg,))

``BASETRAINER_TRACEBACK=1`` in the environment lets the exception through instead (its
traceback, for a bug report). Any other exception keeps its traceback: it is a fault of the
program, not of the input.
"""
import contextlib
import os
import sys
from typing import Iterator

#: set to 1 to see the traceback of a user error instead of its one-line message
TRACEBACK_ENV = "BASETRAINER_TRACEBACK"
#: the exit status of a user error (argparse's, and the deploy and tune commands')
EXIT_USAGE = 2


class UsageError(Exception):
    """An error in the user's input; its message names the key or path, the value and the fix.

    The base of the kinds below (each also the built-in type callers expect); catch this to
    catch them all.
    """


class ConfigError(UsageError, ValueError):
    """A value out of range or an unknown name (a config key, a flag or an argument)."""


class ConfigTypeError(UsageError, TypeError):
    """A value of the wrong type (a config key, a flag or an argument)."""


class PathError(UsageError, FileNotFoundError):
    """A file or folder the user named (data, config file, checkpoint) does not exist."""


class CheckpointError(UsageError, ValueError):
    """A file given as a checkpoint or weights (resume, finetune, pretrained, a deploy source)
    that cannot be used: not a torch file, truncated, damaged, pickled code, or no weights."""


class WorkDirError(UsageError, FileExistsError):
    """A new run in a ``work_dir`` that holds another run's files."""


class FolderError(UsageError, OSError):
    """A folder the run writes (``work_dir``) cannot be made or written by this user."""


class RunBusyError(UsageError, RuntimeError):
    """A ``work_dir`` whose run is still training (another process on this machine)."""


class MissingExtraError(UsageError, ImportError):
    """An optional package is not installed; the message names the pip command (once)."""


def show_traceback() -> bool:
    """Whether ``BASETRAINER_TRACEBACK`` asks for tracebacks of user errors."""
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def other_rank() -> bool:
    """A torchrun/SLURM process other than rank 0: its user error is rank 0's too (the checks
    run alike on every rank, and those decided by rank 0 reach all of them), so rank 0 says it.
    An srun task is known by SLURM's variables before ``launch`` sets ``WORLD_SIZE`` and ``RANK``
    from them (a config error raised before, or by, ``launch``)."""
    env = os.environ
    try:
        if "WORLD_SIZE" in env:
            return int(env["WORLD_SIZE"]) > 1 and int(env.get("RANK", "0")) != 0
        return int(env.get("SLURM_NTASKS", "1")) > 1 and int(env.get("SLURM_PROCID", "0")) != 0
    except ValueError:
        return False


def report(error: BaseException, prog: str = "") -> None:
    """Write ``[prog: ]error: <message>`` on stderr (rank 0 only under torchrun)."""
    if other_rank():
        return
    sys.stdout.flush()   # what the command printed before comes first
    sys.stderr.write(f"{prog + ': ' if prog else ''}error: {error}\n")
    sys.stderr.flush()


@contextlib.contextmanager
def exit_on_usage_error(prog: str = "") -> Iterator[None]:
    """At a command's entry: a :class:`UsageError` inside the block prints ``error: <message>``
    on stderr and exits with status 2 (``SystemExit``); with ``BASETRAINER_TRACEBACK=1`` it is
    raised with its traceback instead. Other exceptions pass unchanged."""
    try:
        yield
    except UsageError as e:
        if show_traceback():
            raise
        report(e, prog)
        raise SystemExit(EXIT_USAGE) from None
