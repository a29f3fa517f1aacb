"""Images for people: ESDF slices as PNG with a perceptual colormap and a distinct colour for unknown."""

from __future__ import annotations

import io
from dataclasses import dataclass

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
    # lazy: Pillow loads only when a PNG is encoded (`import mapper` imports this module)
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(rgb), mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


def nice_step(span: float, target_ticks: int = 6) -> float:
    """A 1-2-5 step (metres) giving about ``target_ticks`` intervals over ``span``."""
    raw = max(span, 1e-9) / max(target_ticks, 1)
    mag = 10.0 ** np.floor(np.log10(raw))
    for m in (1.0, 2.0, 5.0, 10.0):
        if m * mag >= raw:
            return float(m * mag)
    return float(10 * mag)  # pragma: no cover


def _fmt_m(v: float, step: float) -> str:
    decimals = max(0, -int(np.floor(np.log10(step)))) if step < 1 else 0
    return f"{v:.{decimals}f}"


@dataclass
class SliceLayout:
    """Where :func:`render_slice` put things, in image pixels (x right, y down; boxes are x0, y0, x1, y1
    with x1/y1 exclusive). ``scale``: image pixels per slice cell; ``x_ticks_m``/``y_ticks_m``: world
    coordinates of the axis ticks; ``bar_max_m``: the distance at the colour bar's top."""

    map_box: tuple[int, int, int, int]
    scale: int
    bar_box: tuple[int, int, int, int]
    bar_max_m: float
    unknown_swatch: tuple[int, int, int, int]
    inside_swatch: tuple[int, int, int, int]
    scale_bar: tuple[int, int, int, int]
    scale_bar_m: float
    x_ticks_m: list[float]
    y_ticks_m: list[float]


def render_slice(
    slice_, max_distance_m: float | None = None, min_size_px: int = 800, legend: bool = True
) -> tuple[np.ndarray, SliceLayout | None]:
    """uint8 ``[H, W, 3]`` image of an ESDF slice, +y up, and its :class:`SliceLayout`.

    The slice is enlarged by an integer factor (nearest neighbour: one cell = ``scale`` x ``scale`` pixels)
    until its long side reaches ``min_size_px``; with ``legend`` it gets axes with ticks in metres (world
    x, y), a scale bar, and on the right a colour bar of the distance in metres (0 to ``max_distance_m``)
    with swatches for unknown (grey) and inside obstacles (red)."""
    # lazy: Pillow loads only when a PNG is encoded (`import mapper` imports this module)
    from PIL import Image, ImageDraw, ImageFont

    d = slice_.distance
    d = d.detach().cpu().numpy() if isinstance(d, torch.Tensor) else np.asarray(d)
    md = max_distance_m
    if md is None:
        finite = d[np.isfinite(d)]
        md = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    h, w = d.shape
    scale = max(1, int(np.ceil(min_size_px / max(h, w, 1))))
    rgb = np.repeat(np.repeat(colorize_distance(d, md)[::-1], scale, 0), scale, 1)
    if not legend:
        return rgb, None
    res = float(slice_.resolution_m)
    ox, oy = (float(v) for v in slice_.origin_xy)
    font = ImageFont.load_default(size=14)
    left, top, bottom, gap, bar_w, right = 64, 28, 48, 24, 22, 110
    mw, mh = w * scale, h * scale
    W, H = left + mw + gap + bar_w + right, top + max(mh, 260) + bottom
    img = Image.new("RGB", (W, H), (255, 255, 255))
    img.paste(Image.fromarray(np.ascontiguousarray(rgb)), (left, top))
    dr = ImageDraw.Draw(img)
    black = (0, 0, 0)
    dr.rectangle([left - 1, top - 1, left + mw, top + mh], outline=black)
    dr.text((left, 6), f"ESDF slice z = {float(slice_.z_m):.2f} m", fill=black, font=font)

    # axis ticks at multiples of a 1-2-5 step (world metres)
    def ticks(o: float, n: int) -> tuple[float, list[float]]:
        step = nice_step(n * res)
        k0, k1 = int(np.ceil(o / step - 1e-9)), int(np.floor((o + n * res) / step + 1e-9))
        return step, [k * step for k in range(k0, k1 + 1)]

    xstep, xt = ticks(ox, w)
    ystep, yt = ticks(oy, h)
    for x in xt:
        px = left + int(round((x - ox) / res * scale))
        px = min(px, left + mw - 1)
        dr.line([px, top + mh, px, top + mh + 5], fill=black)
        label = _fmt_m(x, xstep)
        dr.text((px - dr.textlength(label, font=font) / 2, top + mh + 7), label, fill=black, font=font)
    for y in yt:
        py = top + mh - int(round((y - oy) / res * scale))
        py = max(py, top)
        dr.line([left - 6, py, left - 1, py], fill=black)
        label = _fmt_m(y, ystep)
        dr.text((left - 8 - dr.textlength(label, font=font), py - 8), label, fill=black, font=font)
    dr.text((left + mw / 2 - 20, top + mh + 26), "x (m)", fill=black, font=font)
    dr.text((4, top + mh / 2 - 8), "y (m)", fill=black, font=font)

    # scale bar: a 1-2-5 length of about a fifth of the width, bottom left inside the map
    sb_m = nice_step(w * res, 5)
    sb_px = max(1, int(round(sb_m / res * scale)))
    sx0, sy0 = left + 10, top + mh - 16
    dr.rectangle([sx0 - 3, sy0 - 18, sx0 + sb_px + 3, sy0 + 8], fill=(255, 255, 255))
    dr.rectangle([sx0, sy0, sx0 + sb_px - 1, sy0 + 5], fill=black)
    dr.text((sx0, sy0 - 17), f"{_fmt_m(sb_m, sb_m)} m", fill=black, font=font)
    scale_bar = (sx0, sy0, sx0 + sb_px, sy0 + 6)

    # colour bar: distance 0 (bottom) .. md (top), labelled in metres; swatches below it
    bx0, bh = left + mw + gap, max(min(mh, 400) - 90, 100)
    by0 = top
    vals = (bh - 1 - np.arange(bh)) / max(bh - 1, 1)  # top = 1
    bar = np.repeat(colormap(vals)[:, None, :], bar_w, 1)
    img.paste(Image.fromarray(np.ascontiguousarray(bar)), (bx0, by0))
    dr.rectangle([bx0 - 1, by0 - 1, bx0 + bar_w, by0 + bh], outline=black)
    bstep = nice_step(md, 5)
    for k in range(int(np.floor(md / bstep + 1e-9)) + 1):
        v = k * bstep
        py = by0 + bh - 1 - int(round(v / md * (bh - 1)))
        dr.line([bx0 + bar_w, py, bx0 + bar_w + 4, py], fill=black)
        dr.text((bx0 + bar_w + 7, py - 8), _fmt_m(v, bstep), fill=black, font=font)
    dr.text((bx0 - 4, by0 + bh + 6), "distance (m)", fill=black, font=font)
    sw = 16
    uy = by0 + bh + 30
    unknown = (bx0, uy, bx0 + sw, uy + sw)
    inside = (bx0, uy + 26, bx0 + sw, uy + 26 + sw)
    for box, rgb_, text in ((unknown, UNKNOWN_RGB, "unknown"), (inside, INSIDE_RGB, "inside obstacle")):
        dr.rectangle([box[0], box[1], box[2] - 1, box[3] - 1], fill=rgb_, outline=black)
        dr.text((box[2] + 6, box[1]), text, fill=black, font=font)
    layout = SliceLayout(
        map_box=(left, top, left + mw, top + mh),
        scale=scale,
        bar_box=(bx0, by0, bx0 + bar_w, by0 + bh),
        bar_max_m=float(md),
        unknown_swatch=(unknown[0] + 1, unknown[1] + 1, unknown[2] - 1, unknown[3] - 1),
        inside_swatch=(inside[0] + 1, inside[1] + 1, inside[2] - 1, inside[3] - 1),
        scale_bar=scale_bar,
        scale_bar_m=sb_m,
        x_ticks_m=xt,
        y_ticks_m=yt,
    )
    return np.asarray(img), layout


def slice_to_png(
    slice_, max_distance_m: float | None = None, min_size_px: int = 800, legend: bool = True
) -> bytes:
    """PNG of an ESDF :class:`~mapper.queries.Slice` (+y up), at least ``min_size_px`` on the long side,
    with axes in metres, a scale bar and a colour bar with the unknown / inside legend (see
    :func:`render_slice`; ``legend=False``: the enlarged slice alone)."""
    rgb, _ = render_slice(slice_, max_distance_m, min_size_px, legend)
    return png_bytes(rgb)
