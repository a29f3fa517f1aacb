"""The kinds of stored layer: each owns its fields, how a voxel is reset, how it decays and its public view.

A :class:`~mapper.layers.BrickLayer` stores bricks of voxels; the subclasses here say what the voxels
mean, so that :class:`~mapper.map.Map` runs decay, clearing, views and statistics over its layers without
branching on their names (nvblox: every layer implements its own decay under one base class).

* :class:`TsdfLayer` (``"tsdf"``): fp16 ``tsdf`` (metres) and ``weight``; with colour, uint8 ``color``
  ``[3]`` and fp16 ``color_weight``. Unobserved: weight 0.
* :class:`OccupancyLayer` (``"occupancy"``): fp16 ``log_odds``, NaN = unknown.
* :class:`ObservedRecord` (``"free"``): the free space observed at the ESDF's voxel
  (:mod:`mapper.integrators.free`), in the occupancy layer's format.

The ESDF layer is derived (never decayed or cleared: it follows its sources) and owned by
:class:`mapper.integrators.esdf.EsdfIntegrator`.
"""

from __future__ import annotations

import torch

from .errors import InvalidArgument
from .grid import IndexGrid
from .layers import PAGE_BRICKS, BrickLayer, FieldSpec

# The one registry of public layer names (``Map(layers=...)``, ``Map.layer(name)``): each with the layers it
# needs (any one of them) and the phrase that says why. The stored kinds below answer the names in their
# ``views``; the ESDF (derived, :mod:`mapper.integrators.esdf`) answers ``"esdf"``.
LAYERS: dict[str, tuple[tuple[str, ...], str]] = {
    "tsdf": ((), ""),
    "color": (("tsdf",), ""),
    "occupancy": ((), ""),
    "esdf": (("tsdf", "occupancy"), " for its surface"),
}


def check_layers(layers) -> tuple[str, ...]:
    """A layer name or names -> a tuple of known names whose needs are met; raises ``InvalidArgument``."""
    layers = (layers,) if isinstance(layers, str) else tuple(layers)
    for name in layers:
        if name not in LAYERS:
            raise InvalidArgument(f"layers: unknown layer {name!r}; expected some of {tuple(LAYERS)}")
    for name in layers:
        needs, why = LAYERS[name]
        if needs and not set(needs) & set(layers):
            raise InvalidArgument(f"layers: {name!r} needs {' or '.join(map(repr, needs))}{why}")
    return layers


class StoredLayer(BrickLayer):
    """A brick layer of one kind at ``voxel_size_m`` (metres). Subclasses define the fields and
    :meth:`reset_voxels`, :meth:`decay_bricks`, :meth:`view`, :meth:`occupied`."""

    kind = ""
    views: tuple[str, ...] = ()  # the names ``Map.layer(name)`` answers from this layer

    def __init__(
        self,
        fields: dict[str, FieldSpec],
        device: torch.device,
        voxel_size_m: float,
        page_bricks: int = PAGE_BRICKS,
    ):
        super().__init__(fields, device, page_bricks)
        self.voxel_size_m = float(voxel_size_m)

    def reset_voxels(self, slots: torch.Tensor, offsets: torch.Tensor) -> None:
        """Make the voxels at (int64 ``[M]`` slot, int64 ``[M]`` offset) unobserved."""
        raise NotImplementedError

    def decay_bricks(self, slots: torch.Tensor, factor: float, threshold: float):
        """Fade the whole bricks at int64 ``[B]`` ``slots`` by ``factor``; values that fall below
        ``threshold`` become unobserved. Returns (bool ``[B, 64]`` voxels that became unobserved now,
        bool ``[B]`` bricks that still hold an observed voxel)."""
        raise NotImplementedError

    def view(self, name: str) -> tuple[IndexGrid, dict[str, torch.Tensor]]:
        """(grid, sidecars in the grid's voxel order) of the view ``name`` (one of :attr:`views`)."""
        raise NotImplementedError

    def occupied(self) -> tuple[IndexGrid, torch.Tensor]:
        """(grid of the layer's voxels, bool ``[N]`` occupied voxels in its voxel order)."""
        raise NotImplementedError

    def extra_stats(self) -> dict:
        """Per-kind statistics beside voxels / bricks / bytes (O(voxels): for ``Map.stats``)."""
        return {}


class TsdfLayer(StoredLayer):
    """Truncated signed distances (metres, positive in front of the surface) and their weights."""

    kind = "tsdf"

    def __init__(
        self, device: torch.device, voxel_size_m: float, with_color: bool = False, page_bricks=PAGE_BRICKS
    ):
        super().__init__(self.field_specs(with_color), device, voxel_size_m, page_bricks)
        self.views = ("tsdf", "color") if with_color else ("tsdf",)

    @staticmethod
    def field_specs(with_color: bool = False) -> dict[str, FieldSpec]:
        """fp16 tsdf (metres) and weight (4 B/voxel); colour adds uint8 RGB + fp16 weight."""
        f = {"tsdf": FieldSpec(torch.float16, (), 0.0), "weight": FieldSpec(torch.float16, (), 0.0)}
        if with_color:
            f["color"] = FieldSpec(torch.uint8, (3,), 0)
            f["color_weight"] = FieldSpec(torch.float16, (), 0.0)
        return f

    def reset_voxels(self, slots: torch.Tensor, offsets: torch.Tensor) -> None:
        for f in ("tsdf", "weight", "color_weight"):
            if f in self.pool.fields:
                self.pool.scatter(f, slots, torch.zeros(slots.numel(), device=self.device), offsets)

    def decay_bricks(self, slots: torch.Tensor, factor: float, threshold: float):
        pool = self.pool
        w_old = pool.gather("weight", slots).to(torch.float32)
        w = w_old * factor
        dead = w < threshold
        died = dead & (w_old > 0)
        w = torch.where(dead, torch.zeros_like(w), w)
        t = torch.where(dead, torch.zeros_like(w), pool.gather("tsdf", slots).to(torch.float32))
        pool.scatter("weight", slots, w)
        pool.scatter("tsdf", slots, t)
        if "color_weight" in pool.fields:
            cw = pool.gather("color_weight", slots).to(torch.float32) * factor
            pool.scatter("color_weight", slots, torch.where(dead, torch.zeros_like(cw), cw))
        return died, ~dead.all(dim=1)

    def view(self, name: str) -> tuple[IndexGrid, dict[str, torch.Tensor]]:
        """``"tsdf"`` -> {"tsdf" float32 metres, "weight" float32}; ``"color"`` -> {"color" uint8 [N, 3],
        "weight" float32}."""
        if name == "color":
            g, d = self.voxel_view(["color", "color_weight"])
            return g, {"color": d["color"], "weight": d["color_weight"].float()}
        g, d = self.voxel_view(["tsdf", "weight"])
        return g, {"tsdf": d["tsdf"].float(), "weight": d["weight"].float()}

    def occupied(self) -> tuple[IndexGrid, torch.Tensor]:
        """Observed voxels within half a voxel of the surface."""
        g, d = self.view("tsdf")
        return g, (d["weight"] > 0) & (d["tsdf"].abs() <= 0.5 * self.voxel_size_m)

    def extra_stats(self) -> dict:
        _, slots = self.brick_table()
        w = self.pool.gather("weight", slots) if slots.numel() else torch.zeros(0, device=self.device)
        return {"observed_voxels": int((w > 0).sum())}


class OccupancyLayer(StoredLayer):
    """Log-odds occupancy (NaN = unknown, never free)."""

    kind = "occupancy"
    views = ("occupancy",)

    def __init__(self, device: torch.device, voxel_size_m: float, page_bricks: int = PAGE_BRICKS):
        super().__init__(self.field_specs(), device, voxel_size_m, page_bricks)

    @staticmethod
    def field_specs() -> dict[str, FieldSpec]:
        """fp16 ``log_odds`` (2 B/voxel), NaN = unknown."""
        return {"log_odds": FieldSpec(torch.float16, (), float("nan"))}

    def reset_voxels(self, slots: torch.Tensor, offsets: torch.Tensor) -> None:
        nan = torch.full((slots.numel(),), float("nan"), device=self.device)
        self.pool.scatter("log_odds", slots, nan, offsets)

    def decay_bricks(self, slots: torch.Tensor, factor: float, threshold: float):
        lo_old = self.pool.gather("log_odds", slots).to(torch.float32)
        lo = lo_old * factor
        lo = torch.where(lo.abs() < threshold, torch.full_like(lo, float("nan")), lo)
        died = torch.isnan(lo) & ~torch.isnan(lo_old)
        self.pool.scatter("log_odds", slots, lo)
        return died, ~torch.isnan(lo).all(dim=1)

    def view(self, name: str = "occupancy") -> tuple[IndexGrid, dict[str, torch.Tensor]]:
        """{"log_odds" float32, NaN = unknown}."""
        g, d = self.voxel_view(["log_odds"])
        return g, {"log_odds": d["log_odds"].float()}

    def occupied(self) -> tuple[IndexGrid, torch.Tensor]:
        """Voxels with log-odds > 0."""
        g, d = self.view()
        return g, d["log_odds"] > 0


def source_layers(layers: tuple[str, ...], device: torch.device, voxel_size_m: float):
    """The stored source layers of a map with public ``layers``: (``TsdfLayer`` with colour when ``"color"``
    is asked for, or None; ``OccupancyLayer`` or None) at ``voxel_size_m``."""
    tsdf = TsdfLayer(device, voxel_size_m, with_color="color" in layers) if "tsdf" in layers else None
    return tsdf, (OccupancyLayer(device, voxel_size_m) if "occupancy" in layers else None)


class ObservedRecord(OccupancyLayer):
    """The free space the sensors' rays crossed, at the ESDF's voxel (:mod:`mapper.integrators.free`):
    the occupancy layer's format (so decay and clearing treat it alike); not a public view."""

    kind = "free"
    views = ()
