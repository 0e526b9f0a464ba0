"""The original's MNN engine path: ``MNNEngine`` (implemented in :mod:`basetrainer.deploy`)."""
from basetrainer.deploy.engines.mnn_runtime import MNNEngine

__all__ = ["MNNEngine"]
