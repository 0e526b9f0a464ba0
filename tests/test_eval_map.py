"""Detection mAP (the original's MapMetric) on torchmetrics' MeanAveragePrecision: a hand-counted
AP, names and indices, equal to pycocotools' COCOeval (a hand-counted case and random ones,
max_detections), exact over 2 ranks holding uneven shares, bad input."""
import numpy as np
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


# ----------------------------------------------------------------------------- COCOeval itself
def _cocoeval(gt, dt, classes, min_iou, max_dets=100):
    """pycocotools' COCOeval on the same boxes (images numbered by sorted name, as MapMetric
    orders them; boxes as given, in float64): ``aps, map`` (AP per class index, None without
    ground truth; the mean of COCO's precision table at IoU ``min_iou``, all areas, ``max_dets``)."""
    import contextlib
    import io

    import numpy as np
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    keys = sorted(set(gt) | set(dt))

    def dataset(info, scored):
        anns = []
        for image, key in enumerate(keys):
            entry = info.get(key, {})
            for j, ((x1, y1, x2, y2), label) in enumerate(zip(entry.get("boxes", []), entry.get("labels", []))):
                anns.append({"id": len(anns) + 1, "image_id": image, "category_id": int(label), "iscrowd": 0,
                             "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1)})
                if scored:
                    anns[-1]["score"] = entry["scores"][j]
        return {"images": [{"id": i} for i in range(len(keys))], "annotations": anns,
                "categories": [{"id": c} for c in range(classes)]}

    coco_gt, coco_dt = COCO(), COCO()
    coco_gt.dataset, coco_dt.dataset = dataset(gt, False), dataset(dt, True)
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt.createIndex()
        coco_dt.createIndex()
        e = COCOeval(coco_gt, coco_dt, "bbox")
        e.params.iouThrs = np.array([min_iou])
        e.params.maxDets = [1, 10, max_dets] if max_dets >= 10 else [max_dets]
        e.evaluate()
        e.accumulate()
        if max_dets == 100:
            e.summarize()
    table = e.eval["precision"][0, :, :, 0, -1]        # [recall points, classes]: area all, max_dets
    aps = [float(table[:, k].mean()) if (table[:, k] > -1).all() else None for k in range(classes)]
    value = float(table[table > -1].mean()) if (table > -1).any() else float("nan")
    if max_dets == 100:   # the table read as COCO's own summary reads it
        assert value == e.stats[0] or (np.isnan(value) and e.stats[0] == -1)
    return aps, value


def _ranked(kinds, missed=0):
    """One image, one class: detections by falling score, each on a ground-truth box of its own
    ('T') or on nothing ('F'), and ``missed`` ground-truth boxes no detection finds."""
    boxes = [[20 * i, 0, 20 * i + 10, 10] for i in range(kinds.count("T") + missed)]
    hits = iter(boxes)
    dets = [next(hits) if k == "T" else [500, 500, 510, 510] for k in kinds]
    return ({"img": {"boxes": boxes, "labels": [0] * len(boxes)}},
            {"img": {"boxes": dets, "labels": [0] * len(dets), "scores": [0.9 - 0.1 * i for i in range(len(dets))]}})


def test_the_ap_is_cocoevals_on_a_case_where_a_float32_recall_point_is_lost():
    pytest.importorskip("pycocotools")
    # 5 ground-truth boxes, detections TP FP FP FP TP TP TP: interpolated precision 1 up to recall
    # 0.2, 4/7 up to recall 0.8, then 0; COCO's 101 points: (21 * 1 + 60 * 4/7) / 101 = 0.5474.
    # torchmetrics' default recall points are a float32 linspace, where 0.8 is 0.8000000119: the
    # point at 0.8 was lost (0.5417)
    gt, dt = _ranked("TFFFTTT", missed=1)
    aps, value = MapMetric(min_iou=0.5).evaluate(gt, dt, ["a"])
    assert value == pytest.approx((21 + 60 * 4 / 7) / 101, abs=1e-7)
    want_aps, want = _cocoeval(gt, dt, 1, 0.5)
    assert aps["a"] == pytest.approx(want_aps[0], abs=1e-9) and value == pytest.approx(want, abs=1e-9)


def _random_case(rng, classes):
    """Images with 0-5 ground-truth boxes and 0-8 detections each (some near a ground truth,
    some anywhere, some with the wrong class); scores of 2 decimals, so some are equal."""
    gt, dt = {}, {}
    for i in range(int(rng.integers(1, 9))):
        name = f"im{int(rng.integers(0, 10 ** 6)):06d}_{i}.jpg"
        truth = []
        for _ in range(int(rng.integers(0, 6))):
            x, y = rng.uniform(0, 80, 2)
            w, h = rng.uniform(4, 30, 2)
            truth.append(([float(x), float(y), float(x + w), float(y + h)], int(rng.integers(0, classes))))
        dets = []
        for _ in range(int(rng.integers(0, 9))):
            if truth and rng.random() < 0.6:
                (x1, y1, x2, y2), label = truth[int(rng.integers(0, len(truth)))]
                jitter = rng.normal(0, 0.15 * (x2 - x1), 4)
                box = [float(x1 + jitter[0]), float(y1 + jitter[1]), float(x2 + jitter[2]), float(y2 + jitter[3])]
                box[2], box[3] = max(box[2], box[0] + 1), max(box[3], box[1] + 1)
                if rng.random() < 0.2:
                    label = int(rng.integers(0, classes))
            else:
                x, y = rng.uniform(0, 80, 2)
                box, label = [float(x), float(y), float(x + 10), float(y + 12)], int(rng.integers(0, classes))
            dets.append((box, label, float(np.round(rng.uniform(0.05, 1.0), 2))))
        if truth or rng.random() < 0.5:
            gt[name] = {"boxes": [b for b, _ in truth], "labels": [c for _, c in truth]}
        if dets or rng.random() < 0.5:
            dt[name] = {"boxes": [b for b, _, _ in dets], "labels": [c for _, c, _ in dets],
                        "scores": [s for _, _, s in dets]}
    return gt, dt


@pytest.mark.parametrize("seed", range(40))
def test_the_aps_equal_cocoevals_on_random_cases(seed):
    pytest.importorskip("pycocotools")
    rng = np.random.default_rng(seed)
    classes = int(rng.integers(1, 5))
    names = [f"c{c}" for c in range(classes)]
    gt, dt = _random_case(rng, classes)
    min_iou = float(rng.choice([0.5, 0.75, 0.3]))
    want_aps, want = _cocoeval(gt, dt, classes, min_iou)
    aps, value = MapMetric(min_iou=min_iou).evaluate(gt, dt, names)
    for c, name in enumerate(names):
        assert (aps[name] is None) == (want_aps[c] is None), (seed, name)
        assert aps[name] == pytest.approx(want_aps[c], abs=1e-6), (seed, name)
    if any(a is not None for a in want_aps):
        assert value == pytest.approx(want, abs=1e-6), seed
    else:
        assert np.isnan(value)


def test_max_detections_at_or_above_an_images_most_detections_gives_the_map_of_100():
    pytest.importorskip("pycocotools")
    gt, dt = _random_case(np.random.default_rng(3), 3)
    most = max(len(e["boxes"]) for e in dt.values())
    full = MapMetric(min_iou=0.5).evaluate(gt, dt, ["a", "b", "c"])
    assert 0 < full[1] < 1 and most >= 5
    for n in sorted({most, most + 1, 10, 11, 50}):      # before: nan for every n <= 10 (and 11, 50)
        assert MapMetric(min_iou=0.5, max_detections=n).evaluate(gt, dt, ["a", "b", "c"]) == full, n
    # fewer: COCOeval keeps the n best-scored detections of each class in each image, as here
    for n in (1, 2, 3):
        want_aps, want = _cocoeval(gt, dt, 3, 0.5, max_dets=n)
        aps, value = MapMetric(min_iou=0.5, max_detections=n).evaluate(gt, dt, ["a", "b", "c"])
        assert value == pytest.approx(want, abs=1e-9) and value != full[1], n
        assert [aps[c] for c in "abc"] == pytest.approx(want_aps, abs=1e-9), n


@pytest.mark.parametrize("bad", [0, -3, 2.5, "100", True, None])
def test_a_max_detections_that_is_not_a_positive_integer_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=rf"max_detections={bad!r}.*integer >= 1"):
        MapMetric(max_detections=bad)
    assert MapMetric(max_detections=np.int64(7)).max_detections == 7
