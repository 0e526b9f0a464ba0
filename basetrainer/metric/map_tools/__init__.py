"""Detection mAP at an IoU (``MapMetric``), as basetrainer 1.0.4 named it
(``basetrainer.metric.map_tools.MapMetric``, also at ``...map_tools.map_metric``)."""
from basetrainer.metric.map_tools.map_metric import MapMetric

__all__ = ["MapMetric"]
