"""ESDF slice PNGs a person can read: size, map pixels, colour bar (metres), legend swatches, axis ticks and
scale bar, checked pixel by pixel against hand-placed values."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from mapper.queries import Slice
from mapper.render import render_slice, slice_to_png

VIRIDIS_0, VIRIDIS_HALF, VIRIDIS_1 = (68, 1, 84), (33, 144, 141), (253, 231, 37)
GREY, RED, BLACK = (128, 128, 128), (165, 0, 38), (0, 0, 0)


def _slice():
    """164 x 144 cells of 5 cm from (-4, -3): unknown border, a far band, a zero band, an inside band."""
    d = np.full((144, 164), np.nan, np.float32)
    d[20:40, 10:150] = 5.0  # beyond max distance (2 m): viridis top
    d[40:60, 10:150] = 0.0
    d[60:80, 10:150] = -0.3  # inside
    d[80:100, 10:150] = 1.0  # half of 2 m
    return Slice(torch.from_numpy(d), (-4.0, -3.0), 0.05, 0.5), d


def _px(img, x, y):
    return tuple(int(v) for v in img[y, x])


def test_slice_png_has_legend_axes_and_scale(tmp_path):
    s, d = _slice()
    png = slice_to_png(s, max_distance_m=2.0)
    img = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    rgb, lay = render_slice(s, max_distance_m=2.0)
    np.testing.assert_array_equal(img, rgb)
    assert max(img.shape[:2]) >= 800 and lay.scale == 5  # 164 cells * 5 px = 820
    x0, y0, x1, y1 = lay.map_box
    assert (x1 - x0, y1 - y0) == (164 * 5, 144 * 5)

    def cell(r, c):  # pixel at the centre of slice cell (row r from the bottom, column c)
        return _px(img, x0 + c * 5 + 2, y1 - 1 - (r * 5 + 2))

    assert cell(5, 80) == GREY and cell(30, 80) == VIRIDIS_1 and cell(50, 80) == VIRIDIS_0
    assert cell(70, 80) == RED and cell(90, 80) == VIRIDIS_HALF
    # colour bar: 0 m at the bottom, 2 m at the top, in viridis
    bx0, by0, bx1, by1 = lay.bar_box
    assert lay.bar_max_m == 2.0
    assert _px(img, bx0 + 5, by0) == VIRIDIS_1 and _px(img, bx0 + 5, by1 - 1) == VIRIDIS_0
    mid = _px(img, bx0 + 5, (by0 + by1 - 1) // 2)
    assert np.abs(np.subtract(mid, VIRIDIS_HALF)).max() <= 3
    # legend swatches
    for box, colour in ((lay.unknown_swatch, GREY), (lay.inside_swatch, RED)):
        patch = img[box[1] : box[3], box[0] : box[2]].reshape(-1, 3)
        assert len(patch) > 50 and (patch == colour).all()
    # ticks every 2 m (1-2-5 step over 8.2 m x 7.2 m), marks below / left of the map, in black
    assert lay.x_ticks_m == [-4.0, -2.0, 0.0, 2.0, 4.0] and lay.y_ticks_m == [-2.0, 0.0, 2.0, 4.0]
    for x in lay.x_ticks_m:
        px = min(x0 + round((x + 4.0) / 0.05 * 5), x1 - 1)
        assert _px(img, px, y1 + 3) == BLACK, x
        assert _px(img, px + 7, y1 + 3) != BLACK  # between ticks: background
    for y in lay.y_ticks_m:
        py = y1 - round((y + 3.0) / 0.05 * 5)
        assert _px(img, x0 - 4, py) == BLACK, y
    # scale bar: 2 m = 40 cells = 200 px, black
    sx0, sy0, sx1, sy1 = lay.scale_bar
    assert lay.scale_bar_m == 2.0 and sx1 - sx0 == 200
    assert (img[sy0:sy1, sx0:sx1] == 0).all()


def test_slice_png_without_legend_and_small_slices():
    s, d = _slice()
    rgb, lay = render_slice(s, max_distance_m=2.0, legend=False)
    assert lay is None and rgb.shape == (144 * 5, 164 * 5, 3)
    tiny = Slice(torch.full((2, 3), float("nan")), (0.0, 0.0), 0.1, 0.0)  # all unknown: still a legend
    img = np.asarray(Image.open(io.BytesIO(slice_to_png(tiny))).convert("RGB"))
    _, lay = render_slice(tiny)
    assert max(img.shape[:2]) >= 800 and lay.scale == 267 and lay.bar_max_m == 1.0
