"""Logging setup: console and file handlers on the ``basetrainer`` logger.

Library modules log through ``logging.getLogger(__name__)``; only :func:`set_logger` installs
handlers. Processes other than the main one log warnings and errors only.
"""
import logging
import os
import sys
from typing import Optional, Union

ROOT = "basetrainer"
_FORMAT = "%(asctime)s %(levelname)s %(filename)s:%(lineno)d] %(message)s"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}


def _level(level: Union[str, int]) -> int:
    if isinstance(level, int):
        return level
    key = str(level).lower()
    if key not in _LEVELS:
        raise ValueError(f"unknown log level {level!r}; choose from {sorted(_LEVELS)}")
    return _LEVELS[key]


def set_logger(level: Union[str, int] = "info", logfile: Optional[str] = None,
               is_main_process: bool = True, name: str = ROOT) -> logging.Logger:
    """Configure and return the ``basetrainer`` logger (idempotent: handlers are replaced).

    Args:
        level: ``debug``, ``info``, ``warning``, ... (or a logging level number).
        logfile: also write to this file (main process only; its folder is created).
        is_main_process: other processes log warnings and errors only, to the console.
        name: the logger to configure (default ``basetrainer``, the parent of every library logger).
    """
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(_level(level) if is_main_process else logging.WARNING)
    fmt = logging.Formatter(_FORMAT, datefmt="%Y-%m-%d %H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    logger.addHandler(console)
    if logfile and is_main_process:
        folder = os.path.dirname(os.path.abspath(logfile))
        os.makedirs(folder, exist_ok=True)
        file_handler = logging.FileHandler(logfile, encoding="utf-8")
        file_handler.setFormatter(fmt)
        logger.addHandler(file_handler)
    logger.propagate = False
    if name != ROOT:  # library messages reach the same handlers
        lib = logging.getLogger(ROOT)
        lib.handlers, lib.propagate = list(logger.handlers), False
        lib.setLevel(logger.level)
    return logger


def get_logger(name: str = ROOT) -> logging.Logger:
    """The ``basetrainer`` logger (configure it with :func:`set_logger`)."""
    return logging.getLogger(name)
