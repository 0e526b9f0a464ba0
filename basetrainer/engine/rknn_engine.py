"""The original's RKNN engine path: ``RKNNEngine``. It needs a Rockchip NPU and Rockchip's
RKNN-Toolkit2 / -Lite2; building one without them is one clear error."""
from basetrainer.deploy.engines.hardware import RKNNEngine

__all__ = ["RKNNEngine"]
