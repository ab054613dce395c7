"""Interpreter-start hook of sglang-tiered (run by `sglang_tiered_boot.pth`): a guard on `import torchvision`.

A top-level module, not part of the `sglang_tiered` package, so that importing it at start-up does not pin where
`sglang_tiered` itself is imported from.

PyPI's torchvision is linked against CUDA torch; with a CPU-only torch its C extension fails to load and its import
dies with `operator torchvision::nms does not exist` — and `import sglang` imports it before any SGLang plugin can
run. The guard waits for the first `import torchvision`; then, only if torch is a CPU build and torchvision's
extension really fails to load, it defines the missing operator schemas (calling one raises NotImplementedError).
Installing the guard costs one object on `sys.meta_path`; nothing is imported at start-up.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

_SCHEMAS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward": "(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, "
    "bool aligned) -> Tensor",
    "roi_pool": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_roi_pool_backward": "(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_align": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward": "(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_ps_roi_pool_backward": "(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, "
    "SymInt width) -> Tensor",
    "deform_conv2d": "(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
    "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, "
    "SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward": "(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, "
    "Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, "
    "SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, "
    "Tensor)",
}
_libraries: list = []  # keeps the torch.library.Library alive


def define_missing_torchvision_ops() -> bool:
    """Define torchvision's operator schemas if torch is a CPU build and torchvision's extension cannot load.

    Returns True if schemas were defined.
    """
    import torch

    if torch.version.cuda is not None or _has_op("nms"):
        return False
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    for so in Path(list(spec.submodule_search_locations)[0]).glob("_C*.so"):
        try:
            torch.ops.load_library(str(so))
            return False  # a matching build: its own schemas are there now
        except (OSError, RuntimeError):
            pass
    lib = torch.library.Library("torchvision", "DEF")
    for name, schema in _SCHEMAS.items():
        if not _has_op(name):
            lib.define(name + schema)
    _libraries.append(lib)
    logging.getLogger("sglang_tiered").debug("defined torchvision operator schemas for a CPU-only torch")
    return True


def _has_op(name: str) -> bool:
    import torch

    try:
        torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
        return True
    except RuntimeError:
        return False


class _TorchvisionGuard:
    """Meta-path finder that acts once, on the first `import torchvision`, then steps aside."""

    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        try:
            define_missing_torchvision_ops()
        except Exception:  # never break an import because of the guard
            pass
        return None


def install() -> None:
    if "torchvision" not in sys.modules and not any(isinstance(f, _TorchvisionGuard) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionGuard())


install()
