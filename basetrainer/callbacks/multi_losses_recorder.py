"""Figures for models whose losses are a dict (or tuple) of named parts."""
from basetrainer.callbacks.losses_recorder import LossesRecorder


class MultiLossesRecorder(LossesRecorder):
    """Like :class:`~basetrainer.callbacks.losses_recorder.LossesRecorder`, and also records
    each part: with losses ``{"cls": a, "box": b}`` it writes ``train/cls``, ``train/box`` and
    ``train/<indicator>`` (their sum), and the same under ``test/``. Parts of a tuple are named
    ``<indicator>0``, ``<indicator>1``, ...

    Args:
        indicator: the name of the total (default ``"loss"``).
    """

    parts = True
