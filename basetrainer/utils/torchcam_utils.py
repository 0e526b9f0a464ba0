"""Class-activation heatmaps (Grad-CAM and kin) over images, on torchcam (extra ``eval``), with
the API of basetrainer 1.0.4's ``TorchCAM``.

Typical use::

    cam = TorchCAM(model, target_layer=None, input_shape=(3, 224, 224), cam_type="GradCAM")
    featuremaps, heatmaps = cam.explain(inputs, images)        # one map and one overlay per image
    cam.save_heatmap(featuremaps, heatmaps, "cam.png")
    cam.remove_hooks()

or, as the original: ``cam.set_image(image)``, run the model, ``cam.set_outputs(outputs)``,
``cam.get_heatmap()``. :func:`cam_grid` draws a grid of images with their heatmaps (what
:class:`~basetrainer.callbacks.eval_report.EvalReport` puts in the report).

``explain`` explains the model's inference (it runs it in eval mode: BatchNorm's running
statistics, no dropout) and leaves the model as it found it: every module's train/eval mode
and every parameter's ``requires_grad`` are put back, no gradient is accumulated into its
parameters (they are frozen for the pass; the gradient flows from the input), no BatchNorm
statistic moves, and the random generators are restored (SmoothGrad-CAM++ draws noise), so a
report during training does not change it — also when it raises.
"""
import io
import logging
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from basetrainer.runtime.errors import MissingExtraError
from basetrainer.runtime.modules import eval_mode, unwrap_model

logger = logging.getLogger(__name__)

INSTALL = 'pip install "basetrainer[eval]"'
CAM_TYPES = ("CAM", "GradCAM", "GradCAMpp", "SmoothGradCAMpp", "XGradCAM", "LayerCAM", "ScoreCAM", "SSCAM",
             "ISCAM")


def _torchcam() -> Any:
    try:
        import torchcam.methods
        import torchcam.utils

        return torchcam
    except ImportError as e:
        raise MissingExtraError(f"TorchCAM needs the torchcam package, which is not installed ({e}): {INSTALL}") from e


def _shape(input_shape: Sequence[int]) -> Tuple[int, ...]:
    """(C, H, W) from (C, H, W), [W, H] (the config's input_size) or (B, C, H, W)."""
    shape = tuple(int(v) for v in input_shape)
    if len(shape) == 2:
        return (3, shape[1], shape[0])
    if len(shape) == 4:
        return shape[1:]
    if len(shape) != 3:
        raise ValueError(f"input_shape={input_shape!r} must be (C, H, W), [W, H] or (B, C, H, W)")
    return shape


def to_image(tensor: torch.Tensor) -> np.ndarray:
    """A model input ``[C, H, W]`` (normalised any way) as an RGB uint8 image, stretched to
    0..255."""
    x = tensor.detach().float().cpu()
    if x.dim() == 2:
        x = x[None]
    if x.shape[0] == 1:
        x = x.repeat(3, 1, 1)
    x = x[:3]
    lo, hi = float(x.min()), float(x.max())
    x = (x - lo) / (hi - lo) if hi > lo else torch.zeros_like(x)
    return (x.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)


class TorchCAM:
    """Class-activation heatmaps of ``model`` at ``target_layer``.

    Args:
        model: the classifier; wrappers (DataParallel, DDP, ``torch.compile``) are looked through
            and the maps are of the module inside (a DDP forward talks to the other processes,
            and Grad-CAM runs on one of them; hooks are put on ``target_layer``).
        target_layer: the layer (a module or its name, in ``model`` or in the module inside
            its wrappers) whose activations are mapped; None: the
            last layer with a spatial output (torchcam finds it with one forward of
            ``input_shape``, in eval mode).
        input_shape: ``(C, H, W)``, or ``[W, H]`` (the config's ``input_size``; 3 channels).
        cam_type: one of :data:`CAM_TYPES` (torchcam's methods).
        flag: kept for the original's signature (unused).

    Raises:
        ValueError: an unknown ``cam_type`` (the valid ones are listed); a model sharded by
            ``fully_shard`` (its forward gathers from every process).
        ImportError: torchcam missing (the pip command named).
    """

    def __init__(self, model: nn.Module, target_layer: Any = None, input_shape: Sequence[int] = (3, 224, 224),
                 cam_type: str = "GradCAM", flag: str = "hm") -> None:
        self.model, target_layer = _inner(model, target_layer)
        self.flag = flag
        self.input_shape = _shape(input_shape)
        self.images: List[Any] = []
        self.names: List[Optional[str]] = []
        self.outputs: Optional[torch.Tensor] = None
        self.features: Optional[torch.Tensor] = None
        self.cam = self.build_cam(cam_type, target_layer, self.input_shape)
        self.target_layer = self.cam.target_names[0] if getattr(self.cam, "target_names", None) else target_layer
        logger.info("TorchCAM: %s on layer %r", cam_type, self.target_layer)

    def build_cam(self, cam_type: str = "GradCAM", target_layer: Any = None,
                  input_shape: Sequence[int] = (3, 224, 224)) -> Any:
        """torchcam's extractor ``cam_type`` on ``self.model`` (hooks put on the layer)."""
        if cam_type not in CAM_TYPES:
            raise ValueError(f"cam_type={cam_type!r}: choose from {list(CAM_TYPES)}")
        methods = _torchcam().methods
        return getattr(methods, cam_type)(self.model, target_layer=target_layer, input_shape=_shape(input_shape))

    def set_image(self, image: Any, name: Optional[str] = None) -> None:
        """The image(s) the heatmaps are drawn over: a PIL image, an ``H x W x 3`` uint8 array,
        a ``[C, H, W]`` tensor, or a list of them (one per sample)."""
        images = image if isinstance(image, list) else [image]
        self.images = [self._rgb(i) for i in images]
        self.names = [name] * len(self.images) if not isinstance(name, list) else list(name)

    @staticmethod
    def _rgb(image: Any) -> np.ndarray:
        if isinstance(image, torch.Tensor):
            return to_image(image)
        array = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image)
        if array.ndim == 2:
            array = np.stack([array] * 3, axis=-1)
        return array.astype(np.uint8)

    def set_outputs(self, outputs: torch.Tensor) -> None:
        """The model's scores ``[B, classes]`` of the forward pass just run (with the hooks on)."""
        self.outputs = outputs

    def set_features(self, features: torch.Tensor) -> None:
        """Activation maps ``[B, h, w]`` computed elsewhere: :meth:`get_heatmap` draws these."""
        self.features = features

    def get_heatmap(self, vis: bool = False, out: str = "", class_idx: Any = None) -> Tuple[List[np.ndarray], List[np.ndarray]]:
        """``featuremaps, heatmaps``: per sample, the map (``float32``, ``[0, 1]``, at the image's
        size when one is set) and the image with the map laid over it (``uint8``, ``H x W x 3``;
        the map alone in colour without an image). ``class_idx``: the class explained per
        sample (default: the predicted one). ``out``: also saved there (:meth:`save_heatmap`).
        ``vis`` is accepted for the original's signature; nothing is shown (no window)."""
        if self.features is not None:
            maps = self.features.detach().float().cpu()
            self.features = None
        else:
            if self.outputs is None:
                raise ValueError("TorchCAM.get_heatmap: run the model on the images and call set_outputs(outputs) "
                                 "first (or use explain(inputs))")
            scores = self.outputs
            if class_idx is None:
                class_idx = scores.argmax(dim=1).tolist()
            maps = self.cam(class_idx, scores)[0].detach().float().cpu()
        if maps.dim() == 2:
            maps = maps[None]
        featuremaps, heatmaps = [], []
        for i, m in enumerate(maps):
            image = self.images[i] if i < len(self.images) else None
            fm, hm = _overlay(m, image)
            featuremaps.append(fm)
            heatmaps.append(hm)
        if out:
            self.save_heatmap(featuremaps, heatmaps, out)
        return featuremaps, heatmaps

    def draw_heatmap_from_output(self, features: torch.Tensor, vis: bool = False) -> Tuple[List[np.ndarray], List[np.ndarray]]:
        """:meth:`get_heatmap` for the scores ``features`` (the model's outputs)."""
        self.set_outputs(features)
        return self.get_heatmap(vis=vis)

    def explain(self, inputs: torch.Tensor, images: Any = None, class_idx: Any = None) -> Tuple[List[np.ndarray], List[np.ndarray]]:
        """Forward ``inputs`` in eval mode and map the class ``class_idx`` (default: the
        predicted one) of each.

        The parameters are frozen for the pass (nothing lands in their ``.grad``); every module's
        mode, the parameters' ``requires_grad`` and the random generators are put back after it,
        also when it raises.
        """
        frozen = [p for p in self.model.parameters() if p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        devices = [torch.cuda.current_device()] if inputs.is_cuda else []
        try:
            with eval_mode(self.model), torch.random.fork_rng(devices=devices), torch.enable_grad():
                x = inputs.detach().clone().requires_grad_(True)
                self.set_image(list(images) if images is not None else [to_image(t) for t in inputs])
                self.set_outputs(self.model(x))
                return self.get_heatmap(class_idx=class_idx)
        finally:
            for p in frozen:
                p.requires_grad_(True)
            self.outputs = None

    def save_heatmap(self, featuremaps: Sequence[np.ndarray], heatmaps: Sequence[np.ndarray], out: str,
                     combine: bool = True) -> str:
        """Write the heatmaps to ``out`` as one PNG (side by side when ``combine``, each overlay
        beside its map; else the overlays only)."""
        from PIL import Image

        from basetrainer.runtime import atomic

        tiles = []
        for fm, hm in zip(featuremaps, heatmaps):
            tiles.append(np.concatenate([hm, _colour(fm)], axis=1) if combine else hm)
        height = max(t.shape[0] for t in tiles)
        row = np.concatenate([np.pad(t, ((0, height - t.shape[0]), (0, 0), (0, 0))) for t in tiles], axis=1)
        buf = io.BytesIO()
        Image.fromarray(row).save(buf, format="PNG")
        return atomic.write_atomically(buf.getvalue(), out)

    def remove_hooks(self) -> None:
        """Take the hooks off the model."""
        self.cam.remove_hooks()

    def __enter__(self) -> "TorchCAM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove_hooks()


def _inner(model: nn.Module, target_layer: Any = None) -> Tuple[nn.Module, Any]:
    """The module inside ``model``'s wrappers, and ``target_layer`` named in it (a name given in
    the wrapped model, ``module.layer4``, loses the wrapper's prefix).

    Raises:
        ValueError: the model is sharded by ``fully_shard``.
    """
    from basetrainer.runtime import sharding

    inner = unwrap_model(model)
    if sharding.is_fsdp(inner):
        raise ValueError(f"Grad-CAM needs the whole model, and this {type(inner).__name__} is sharded (fully_shard): "
                         f"its forward gathers from every process. Map it unsharded: build it in one process and load the "
                         f"run's checkpoint (a get_models net: basetrainer.deploy.source.load_model("
                         f"'<work_dir>/model/last.pth').model)")
    if isinstance(target_layer, str) and inner is not model:
        prefix = next((name for name, m in model.named_modules() if m is inner), "")
        if prefix and target_layer.startswith(prefix + "."):
            target_layer = target_layer[len(prefix) + 1:]
    return inner, target_layer


def _colour(featuremap: np.ndarray) -> np.ndarray:
    import matplotlib

    return (matplotlib.colormaps["jet"](featuremap)[..., :3] * 255).round().astype(np.uint8)


def _overlay(cam_map: torch.Tensor, image: Optional[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    """The map resized to the image (bilinear), and the image with the map over it (torchcam's
    ``overlay_mask``)."""
    from PIL import Image

    m = cam_map.numpy().astype(np.float32)
    m = np.nan_to_num(m)
    if image is None:
        return m, _colour(np.clip(m, 0, 1))
    h, w = image.shape[:2]
    resized = np.asarray(Image.fromarray(m).resize((w, h), Image.BILINEAR), dtype=np.float32)
    resized = np.clip(resized, 0.0, 1.0)
    overlay = _torchcam().utils.overlay_mask(Image.fromarray(image), Image.fromarray(m), alpha=0.5)
    return resized, np.asarray(overlay.convert("RGB"), dtype=np.uint8)


def cam_grid(model: nn.Module, inputs: torch.Tensor, labels: Sequence[int], path: str,
             class_names: Optional[Sequence[str]] = None, target_layer: Any = None, cam_type: str = "GradCAM",
             columns: int = 4, scale: int = 0) -> str:
    """Draw ``inputs`` (``[B, C, H, W]``) with their ``cam_type`` heatmaps of the predicted
    class as a grid PNG at ``path`` (each cell: the overlay, titled true / predicted class).
    Small images are enlarged (``scale``; 0: to about 160 pixels) so the map can be seen."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from PIL import Image

    from basetrainer.runtime import atomic

    if inputs.dim() != 4:
        raise ValueError(f"cam_grid needs image inputs [B, C, H, W]; got shape {tuple(inputs.shape)}")
    model, target_layer = _inner(model, target_layer)   # its prediction below: the module, not DDP's forward
    h, w = inputs.shape[-2:]
    scale = scale or max(1, 160 // max(h, w))
    images = [np.asarray(Image.fromarray(to_image(t)).resize((w * scale, h * scale), Image.NEAREST)) for t in inputs]
    with eval_mode(model), TorchCAM(model, target_layer=target_layer, input_shape=tuple(inputs.shape[1:]),
                                    cam_type=cam_type) as cam:
        featuremaps, heatmaps = cam.explain(inputs, images)
        with torch.no_grad():
            pred = model(inputs).argmax(dim=1).tolist()
    names = [str(c) for c in class_names] if class_names is not None else None
    n = len(heatmaps)
    cols = max(1, min(columns, n))
    rows = (n + cols - 1) // cols
    fig = Figure(figsize=(2.6 * cols, 2.9 * rows), dpi=100)
    FigureCanvasAgg(fig)
    for i, (hm, label, p) in enumerate(zip(heatmaps, labels, pred)):
        ax = fig.add_subplot(rows, cols, i + 1)
        ax.imshow(hm)
        ax.set_axis_off()
        true_name = names[int(label)] if names else str(int(label))
        pred_name = names[int(p)] if names else str(int(p))
        ax.set_title(f"true {true_name} / pred {pred_name}", fontsize=9,
                     color="black" if int(label) == int(p) else "red")
    fig.suptitle(f"{cam_type} of the predicted class (layer {cam.target_layer})", fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return atomic.write_atomically(buf.getvalue(), path)
