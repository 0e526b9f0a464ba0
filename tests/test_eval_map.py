"""Detection mAP (the original's MapMetric) on torchmetrics' MeanAveragePrecision: a hand-counted
AP, names and indices, exact over 2 ranks holding uneven shares, bad input."""
import pytest

from basetrainer.runtime import comm

from conftest import run_distributed

pytest.importorskip("torchmetrics")
from basetrainer.metric.map_tools import MapMetric  # noqa: E402
from basetrainer.metric.map_tools.map_metric import MapMetric as DeepPath  # noqa: E402  (the original's module)


def test_ap_of_a_hand_counted_case():
    # two ground-truth boxes; detections by score: hit, miss, hit. Precision 1 up to recall 0.5,
    # then 2/3 up to recall 1: COCO's 101 recall points give (51 * 1 + 50 * 2/3) / 101
    gt = {"img": {"boxes": [[0, 0, 10, 10], [20, 20, 30, 30]], "labels": [0, 0]}}
    dt = {"img": {"boxes": [[0, 0, 10, 10], [50, 50, 60, 60], [20, 20, 30, 31]], "labels": [0, 0, 0],
                  "scores": [0.9, 0.8, 0.7]}}
    aps, value = MapMetric(min_iou=0.5).evaluate(gt, dt, class_name=["thing"])
    assert value == pytest.approx((51 + 50 * 2 / 3) / 101, abs=1e-6)
    assert aps == {"thing": pytest.approx(value, abs=1e-9)}
    # the third box overlaps its ground truth by 100/110 = 0.909: a miss at IoU 0.95
    aps, value = MapMetric(min_iou=0.95).evaluate(gt, dt, class_name=["thing"])
    assert value == pytest.approx(51 / 101 * 1.0, abs=1e-6)
    assert DeepPath is MapMetric


def test_labels_by_name_and_a_class_without_ground_truth():
    info = {}
    MapMetric.build_data_info(info, "a.jpg", [[0, 0, 5, 5]], ["cat"], class_name=["cat", "dog", "owl"])
    dets = {}
    MapMetric.build_data_info(dets, "a.jpg", [[0, 0, 5, 5], [9, 9, 12, 12]], ["cat", "owl"], score=[0.8, 0.6],
                              class_name=["cat", "dog", "owl"])
    aps, value = MapMetric().evaluate(info, dets, ["cat", "dog", "owl"])
    assert aps["cat"] == pytest.approx(1.0) and aps["dog"] is None
    assert value == pytest.approx(1.0)     # the mean over the classes that have ground truth


def _shares():
    """7 images; many detections share a score, so the order of images matters to COCO."""
    gt, dt = {}, {}
    for i in range(7):
        x = 10 * i
        gt[f"img{i}.jpg"] = {"boxes": [[x, 0, x + 8, 8], [x, 20, x + 8, 28]], "labels": [i % 2, 1]}
        dt[f"img{i}.jpg"] = {"boxes": [[x, 0, x + 8, 8], [x + 50, 50, x + 58, 58], [x, 21, x + 8, 29]],
                             "labels": [i % 2, 0, 1], "scores": [0.5, 0.5, 0.5 if i % 3 else 0.9]}
    return gt, dt


def _on_ranks(rank, names):
    gt, dt = _shares()
    keys = sorted(gt)[rank::comm.get_world_size()]      # rank 0: 4 images, rank 1: 3
    metric = MapMetric(min_iou=0.5)
    result = metric.evaluate({k: gt[k] for k in keys}, {k: dt[k] for k in keys}, names)
    try:
        MapMetric().evaluate(gt, dt, names)              # every rank the same images: refused
        twice = "no error"
    except ValueError as e:
        twice = str(e)
    return {"result": result, "images": len(keys), "twice": twice}


@pytest.mark.distributed
def test_two_ranks_holding_uneven_shares_give_one_process_figures(tmp_path):
    names = ["a", "b"]
    gt, dt = _shares()
    one = MapMetric(min_iou=0.5).evaluate(gt, dt, names)
    ranks = run_distributed(_on_ranks, 2, tmp_path, names, timeout=180)
    assert [r["images"] for r in ranks] == [4, 3]
    for r in ranks:
        assert r["result"][1] == one[1] and r["result"][0] == one[0]     # exactly
        assert "more than one rank" in r["twice"]
    assert 0 < one[1] < 1


def test_bad_input_is_a_clear_error():
    m = MapMetric()
    with pytest.raises(ValueError, match="2 boxes but 1 labels"):
        m.evaluate({"x": {"boxes": [[0, 0, 1, 1], [1, 1, 2, 2]], "labels": [0]}}, {}, ["a"])
    with pytest.raises(ValueError, match="a score per box"):
        m.evaluate({}, {"x": {"boxes": [[0, 0, 1, 1]], "labels": [0]}}, ["a"])
    with pytest.raises(ValueError, match="'zebra' is not in class_name"):
        m.evaluate({"x": {"boxes": [[0, 0, 1, 1]], "labels": ["zebra"]}}, {}, ["a"])
    with pytest.raises(ValueError, match="outside class_name"):
        m.evaluate({"x": {"boxes": [[0, 0, 1, 1]], "labels": [3]}}, {}, ["a"])
    with pytest.raises(ValueError, match="min_iou"):
        MapMetric(min_iou=1.5)
    with pytest.raises(ValueError, match="backend"):
        MapMetric(backend="yolo")
