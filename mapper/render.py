"""Images for people: ESDF slices as PNG with a perceptual colormap and a distinct colour for unknown."""

from __future__ import annotations

import io

import numpy as np
import torch

# viridis sampled at 9 points (0, 1/8, ..., 1); linear interpolation between them is within a few
# units of the full table and stays perceptually uniform and colour-blind safe
_VIRIDIS = np.array(
    [
        [68, 1, 84],
        [71, 44, 122],
        [59, 81, 139],
        [44, 113, 142],
        [33, 144, 141],
        [39, 173, 129],
        [92, 200, 99],
        [170, 220, 50],
        [253, 231, 37],
    ],
    dtype=np.float64,
)
_ROWS = 1 << 16  # pixels per chunk of the colour mapping
UNKNOWN_RGB = (128, 128, 128)  # viridis never has R == G == B
INSIDE_RGB = (165, 0, 38)  # occupied / inside obstacles (negative distance)


def colormap(values01: np.ndarray) -> np.ndarray:
    """uint8 ``[..., 3]`` viridis colours of values in [0, 1] (clipped)."""
    x = np.clip(np.nan_to_num(values01, nan=0.0), 0.0, 1.0) * (len(_VIRIDIS) - 1)
    i = np.minimum(np.floor(x).astype(np.int64), len(_VIRIDIS) - 2)
    f = (x - i)[..., None]
    return np.round(_VIRIDIS[i] * (1 - f) + _VIRIDIS[i + 1] * f).astype(np.uint8)


def colorize_distance(distance, max_distance_m: float) -> np.ndarray:
    """uint8 ``[H, W, 3]``: free space by viridis over [0, max_distance_m], inside (d < 0) in
    ``INSIDE_RGB``, unknown (NaN) in ``UNKNOWN_RGB``."""
    d = distance.detach().cpu().numpy() if isinstance(distance, torch.Tensor) else np.asarray(distance)
    rgb = np.empty((*d.shape, 3), dtype=np.uint8)
    flat, out = d.reshape(-1), rgb.reshape(-1, 3)
    for a in range(0, flat.size, _ROWS):  # chunks: the colormap's float64 temporaries are ~100 B/pixel
        x = flat[a : a + _ROWS]
        o = colormap(x / max(max_distance_m, 1e-9))
        o[np.nan_to_num(x, nan=1.0) < 0] = INSIDE_RGB
        o[np.isnan(x)] = UNKNOWN_RGB
        out[a : a + _ROWS] = o
    return rgb


def png_bytes(rgb: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(rgb), mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


def slice_to_png(slice_, max_distance_m: float | None = None) -> bytes:
    """PNG of an ESDF :class:`~mapper.queries.Slice` (row 0 = lowest y, so it is flipped to put +y up)."""
    d = slice_.distance
    d = d.detach().cpu().numpy() if isinstance(d, torch.Tensor) else np.asarray(d)
    md = max_distance_m
    if md is None:
        finite = d[np.isfinite(d)]
        md = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    rgb = colorize_distance(d, md)
    return png_bytes(rgb[::-1])
