"""The original's NCNN engine path: ``NCNNEngine`` (implemented in :mod:`basetrainer.deploy`)."""
from basetrainer.deploy.engines.ncnn_runtime import NCNNEngine

__all__ = ["NCNNEngine"]
