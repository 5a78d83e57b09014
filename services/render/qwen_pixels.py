"""Qwen-VL pixels exactly as vLLM's render produces them: raw uint8 patches, resized like torchvision.

vLLM (0.32, 0.33) runs the Qwen2-VL image processor on transformers' torchvision backend with
rescale and normalise turned off (`mm_device_do_normalize`, its default): the model normalises
on the device.  So a Qwen-VL item's `pixel_values` is **uint8**, 4x smaller than float32, and
its values are torchvision's resize of the decoded image.  transformers' PIL backend (the only
one epd can load: the registry's torchvision breaks transformers next to the CPU torch, see
FACTS.md) resizes differently (up to 21/255 levels apart at 300x200), which changes tokens.

This module reproduces the torchvision path bit for bit, in numpy (render never imports torch):

1. `smart_resize` (transformers' own function) picks the size: multiples of patch*merge within
   [min_pixels, max_pixels];
2. the resize is what torchvision's `resize_image` does for a uint8 CPU tensor with BICUBIC and
   antialias: torch's native uint8 antialiased kernel (from Pillow-SIMD), ported in
   `resize_uint8`: per output pixel, Keys cubic weights (a = -0.5) over a support of 2*scale
   (when shrinking), normalised in float64, then fixed point int16 with the largest precision
   that fits; a horizontal pass, then a vertical one, each rounding (+ 1 << (precision-1)),
   shifting and clamping to uint8.  Skipped when the size does not change.  Checked against
   `torch.nn.functional.interpolate(..., mode="bicubic", antialias=True)` on uint8 for random
   sizes (tests/services/render/test_qwen_pixels.py) and against a real vLLM (tests/interop).
   Each pass runs in services/kernels/resize.c (built at install; ~6x faster than numpy on a
   1024x768 image), or in numpy where it does not run (--kernels-off resize): the same weights,
   the same int32 sums, the same bytes;
3. the patch layout is the processor's `patchify`: [grid_h*grid_w, C*T*P*P], each frame repeated
   temporal_patch_size times.

Normalisation happens at the encoder (`services.models.input_norm`).
"""

from __future__ import annotations

import ctypes
import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)
_KERNEL: list[Any] = []  # [the C pass, or None where it does not run]: loaded once per process
SPLIT_PIXELS = 512 * 1024
"""From this many output pixels one image's resize and patch copy run as two halves on two threads (the C
pass and numpy's copy let go of the GIL): a 1024x768 image's 11.9 + 2.1 ms take ~7 on two idle cores.
Smaller images (448x448: 0.2 M pixels) stay on one thread, so render's workers keep one image per core."""
_HELPER: list[Any] = []  # the second thread's executor, made at the first large image


@dataclass(frozen=True)
class QwenPixelSettings:
    """The processor settings that decide the pixels (from the checkpoint's preprocessor config)."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int

    @classmethod
    def from_processor(cls, hf: Any) -> QwenPixelSettings | None:
        """The settings of a Qwen-VL image processor; None for any other processor."""
        size = getattr(hf, "size", None)
        needed = (getattr(hf, "patch_size", None), getattr(hf, "merge_size", None),
                  getattr(hf, "temporal_patch_size", None))
        if size is None or any(v is None for v in needed) or "Qwen2VL" not in type(hf).__name__:
            return None
        lo, hi = _get(size, "shortest_edge"), _get(size, "longest_edge")
        if lo is None or hi is None:
            return None
        return cls(int(lo), int(hi), *(int(v) for v in needed))  # type: ignore[arg-type]


def _get(size: Any, key: str) -> Any:
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def resized_size(height: int, width: int, settings: QwenPixelSettings) -> tuple[int, int]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize(height, width, factor=settings.patch_size * settings.merge_size,
                        min_pixels=settings.min_pixels, max_pixels=settings.max_pixels)


def _keys_cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _int16_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """torch's compute_indices_int16_weights_aa for bicubic: (first index, int weights [out, K], precision)."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    ksize = int(math.ceil(support)) * 2 + 1
    center = scale * (np.arange(out_size) + 0.5)
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)
    xsize = np.minimum((center + support + 0.5).astype(np.int64), in_size) - xmin
    j = np.arange(ksize)
    w = _keys_cubic((j[None, :] + xmin[:, None] - center[:, None] + 0.5) * invscale)
    w = np.where(j[None, :] < xsize[:, None], w, 0.0)
    total = w.sum(axis=1, keepdims=True)
    w = np.divide(w, total, out=w.copy(), where=total != 0)
    precision = 0
    for precision in range(22):  # the largest precision whose largest weight still fits an int16
        if int(0.5 + w.max() * (1 << (precision + 1))) >= 1 << 15:
            break
    scaled = w * (1 << precision)
    return xmin, np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5)).astype(np.int64), precision


def _resample(array: np.ndarray, axis: int, out_size: int) -> np.ndarray:
    """One pass along `axis`, accumulated in int32 as torch's (and Pillow's) kernel does: |acc| stays below
    255 * 1.25 * 2**21 for every precision _int16_weights picks.  Taps are gathered along `axis` in place
    (no moved axis, no int64): ~5-9x faster than gathering int64 along a moved axis, bit for bit the same."""
    xmin, weights, precision = _int16_weights(array.shape[axis], out_size)
    last = array.shape[axis] - 1
    source = array.astype(np.int32)
    shape = list(array.shape)
    shape[axis] = out_size
    acc = np.full(shape, 1 << (precision - 1), dtype=np.int32)
    along = [1] * array.ndim
    along[axis] = out_size
    for k in range(weights.shape[1]):  # one tap at a time: memory stays one image
        taps = np.take(source, np.minimum(xmin + k, last), axis=axis)
        taps *= weights[:, k].astype(np.int32).reshape(along)
        acc += taps
    acc >>= precision
    return np.clip(acc, 0, 255).astype(np.uint8)


def resample_kernel() -> Any:
    """The compiled pass (`epd_resample_uint8`, services/kernels/resize.c), or None where it does not run
    (numpy then)."""
    if not _KERNEL:
        from services import kernels

        try:
            fn = kernels.library("resize").epd_resample_uint8
            ptr, i64 = ctypes.c_void_p, ctypes.c_int64
            fn.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, ctypes.c_int32, ptr]
            fn.restype = None
            _KERNEL.append(fn)
        except OSError as exc:
            log.warning("image resize runs in numpy (%s)", exc)
            _KERNEL.append(None)
    return _KERNEL[0]


def _helper() -> Any:
    if not _HELPER:
        from concurrent.futures import ThreadPoolExecutor

        _HELPER.append(ThreadPoolExecutor(1, thread_name_prefix="render-half"))
    return _HELPER[0]


def _in_halves(fn: Any, count: int, halves: bool) -> None:
    """fn(start, stop) over [0, count): in two halves at once (the second on the helper thread) or whole."""
    if not halves or count < 2:
        fn(0, count)
        return
    middle = count // 2
    second = _helper().submit(fn, middle, count)
    fn(0, middle)
    second.result()


def _resample_c(kernel: Any, hwc: np.ndarray, axis: int, out_size: int, halves: bool = False) -> np.ndarray:
    """One pass along `axis` (0: height, 1: width) of a contiguous [H, W, C] uint8 array, in C; with `halves`
    its rows in two halves on two threads (each output row is computed alone: the same bytes either way)."""
    xmin, weights, precision = _int16_weights(hwc.shape[axis], out_size)
    n_in = hwc.shape[axis]
    inner = hwc.shape[1] * hwc.shape[2] if axis == 0 else hwc.shape[2]
    shape = list(hwc.shape)
    shape[axis] = out_size
    out = np.empty(shape, dtype=np.uint8)
    first = np.ascontiguousarray(xmin, dtype=np.int64)
    taps = np.ascontiguousarray(weights, dtype=np.int32)
    ntaps = taps.shape[1]

    def rows(start: int, stop: int) -> None:
        scratch = np.empty(inner, dtype=np.int32)
        if axis == 1:   # input rows [start, stop) -> the same output rows
            kernel(hwc.ctypes.data + start * n_in * inner, stop - start, n_in, inner,
                   out.ctypes.data + start * out_size * inner, out_size, first.ctypes.data, taps.ctypes.data,
                   ntaps, precision, scratch.ctypes.data)
        else:           # output rows [start, stop), each from its own taps of the whole input
            kernel(hwc.ctypes.data, 1, n_in, inner, out.ctypes.data + start * inner, stop - start,
                   first.ctypes.data + start * 8, taps.ctypes.data + start * ntaps * 4, ntaps, precision,
                   scratch.ctypes.data)

    _in_halves(rows, hwc.shape[0] if axis == 1 else out_size, halves)
    return out


def resize_uint8(chw: np.ndarray, height: int, width: int, use_c: bool = True, halves: bool = False) -> np.ndarray:
    """torchvision's uint8 CPU BICUBIC antialiased resize of a [C, H, W] array (horizontal, then vertical).
    `use_c=False` forces the numpy passes (tests compare both with torch); `halves`: the C passes in two
    halves on two threads."""
    if width == chw.shape[2] and height == chw.shape[1]:
        return chw
    kernel = resample_kernel() if use_c else None
    if kernel is None:
        out = chw
        if width != chw.shape[2]:
            out = _resample(out, 2, width)
        if height != chw.shape[1]:
            out = _resample(out, 1, height)
        return out
    hwc = np.ascontiguousarray(chw.transpose(1, 2, 0))  # no copy for a decoded image's [H, W, C] memory
    if width != hwc.shape[1]:
        hwc = _resample_c(kernel, hwc, 1, width, halves)
    if height != hwc.shape[0]:
        hwc = _resample_c(kernel, hwc, 0, height, halves)
    return hwc.transpose(2, 0, 1)


def patchify(chw: np.ndarray, settings: QwenPixelSettings, halves: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values [grid_h*grid_w, C*T*P*P], image_grid_thw [1, grid_h, grid_w]) of one resized image;
    `halves`: the copy in two halves on two threads."""
    p, m, t = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    c, height, width = chw.shape
    grid_h, grid_w = height // p, width // p
    patches = chw.reshape(c, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    out = np.empty(frames.shape, dtype=frames.dtype)
    _in_halves(lambda start, stop: np.copyto(out[start:stop], frames[start:stop]), frames.shape[0], halves)
    pixels = out.reshape(grid_h * grid_w, c * t * p * p)
    return pixels, np.array([1, grid_h, grid_w], dtype=np.int64)


def qwen_pixels(image: Image.Image, settings: QwenPixelSettings) -> dict[str, np.ndarray]:
    """vLLM's per-image Qwen-VL kwargs, in its key order: image_grid_thw, then uint8 pixel_values."""
    chw = np.asarray(image.convert("RGB") if image.mode != "RGB" else image).transpose(2, 0, 1)
    height, width = resized_size(chw.shape[1], chw.shape[2], settings)
    halves = height * width >= SPLIT_PIXELS
    pixels, grid = patchify(resize_uint8(chw, height, width, halves=halves), settings, halves)
    return {"image_grid_thw": grid, "pixel_values": pixels}
