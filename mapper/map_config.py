"""A map's settings: the constructor arguments of :class:`~mapper.map.Map`, checked once, and their JSON form.

``MapConfig.check`` turns the arguments into well-formed values and the integrators' configurations
(``TsdfConfig``, ``OccupancyConfig``, ``OdometryConfig``), raising ``InvalidArgument`` /
``InvalidArgumentType`` naming the argument; ``MapConfig.to_dict`` is ``Map.config()``, so
``Map(**m.config())`` makes an empty twin (the service logs it, snapshots store it). ``build_layers`` and
``integrators`` make what a map of these settings holds and runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._validation import positive
from .errors import InvalidArgument, InvalidArgumentType
from .integrators.esdf import EsdfIntegrator
from .integrators.free import FreeSpaceIntegrator
from .integrators.occupancy import OccupancyConfig, OccupancyIntegrator
from .integrators.tsdf import TsdfConfig, TsdfIntegrator
from .layer_kinds import ObservedRecord, OccupancyLayer, TsdfLayer, check_layers, source_layers
from .registration import OdometryConfig
from .sharding import ShardSpec

# the fields of ``OccupancyConfig`` a map's config carries (its voxel is the map's)
OCCUPANCY_FIELDS = ("l_hit", "l_miss", "clamp_min", "clamp_max")


@dataclass(frozen=True)
class MapConfig:
    """Checked settings of a map (see ``Map``'s Args for each)."""

    voxel_size_m: float
    layers: tuple[str, ...]
    esdf_voxel_size_m: float
    max_range_m: float
    esdf_max_distance_m: float
    keep_radius_m: float | None
    shard: ShardSpec | None
    registration: dict  # the fields of OdometryConfig as given (the rest take their defaults)
    tsdf_config: TsdfConfig
    occupancy_config: OccupancyConfig
    registration_config: OdometryConfig

    @classmethod
    def check(
        cls,
        voxel_size_m,
        layers,
        truncation_vox,
        esdf_max_distance_m,
        max_range_m,
        tsdf_max_weight,
        tsdf_obs_weight,
        occupancy,
        registration,
        keep_radius_m,
        esdf_voxel_size_m,
        shard,
    ) -> MapConfig:
        """The ``Map`` constructor's arguments (but the device and the warm-up) -> ``MapConfig``."""
        s = positive("voxel_size_m", voxel_size_m)
        shard = None if shard is None else ShardSpec.from_dict(shard)
        keep_radius_m = positive("keep_radius_m", keep_radius_m, allow_none=True)
        es = positive("esdf_voxel_size_m", max(s, 0.05) if esdf_voxel_size_m is None else esdf_voxel_size_m)
        if es < s:
            raise InvalidArgument(
                f"esdf_voxel_size_m: expected a value >= voxel_size_m ({s}), got {esdf_voxel_size_m}"
            )
        layers = check_layers(layers)
        max_range_m = positive("max_range_m", max_range_m)
        esdf_max_distance_m = positive("esdf_max_distance_m", esdf_max_distance_m)
        tsdf = TsdfConfig(
            s,
            positive("truncation_vox", truncation_vox),
            positive("tsdf_obs_weight", tsdf_obs_weight),
            positive("tsdf_max_weight", tsdf_max_weight),
            with_color="color" in layers,
        )
        try:
            occ = OccupancyConfig(s, **(occupancy or {}))
        except TypeError as e:
            raise InvalidArgument(f"occupancy: {e}") from None
        if registration is not None and not isinstance(registration, dict):
            raise InvalidArgumentType(f"registration: expected a dict, got {type(registration).__name__}")
        registration = dict(registration or {})
        try:
            odometry = OdometryConfig(**{"max_range_m": max_range_m, **registration})
        except (TypeError, InvalidArgument) as e:
            raise InvalidArgument(f"registration: {e}") from None
        return cls(
            s,
            layers,
            es,
            max_range_m,
            esdf_max_distance_m,
            keep_radius_m,
            shard,
            registration,
            tsdf,
            occ,
            odometry,
        )

    def build_layers(self, device: torch.device):
        """Empty layers on ``device``: (``TsdfLayer`` or None, ``OccupancyLayer`` or None,
        ``ObservedRecord`` (the free space observed at the ESDF's voxel, :mod:`mapper.integrators.free`)
        or None, ``EsdfIntegrator`` (the derived ESDF layer and its updater) or None)."""
        tsdf, occ = source_layers(self.layers, device, self.voxel_size_m)
        if "esdf" not in self.layers:
            return tsdf, occ, None, None
        es = self.esdf_voxel_size_m
        esdf = EsdfIntegrator(es, self.esdf_max_distance_m, device, source_voxel_size_m=self.voxel_size_m)
        free = ObservedRecord(device, es) if occ is None or not esdf.same_lattice else None
        return tsdf, occ, free, esdf

    def integrators(self) -> dict[type, object]:
        """The integrator of each stored layer kind (the contract of :mod:`mapper.integrators.base`)."""
        tau = self.tsdf_config.tau if "tsdf" in self.layers else 0.0
        return {
            TsdfLayer: TsdfIntegrator(self.tsdf_config),
            OccupancyLayer: OccupancyIntegrator(self.occupancy_config),
            ObservedRecord: FreeSpaceIntegrator(self.esdf_voxel_size_m, tau),
        }

    def to_dict(self) -> dict:
        """The constructor arguments (JSON-serialisable); the device and the warm-up are not part of it."""
        return {
            "voxel_size_m": self.voxel_size_m,
            "layers": list(self.layers),
            "truncation_vox": self.tsdf_config.truncation_vox,
            "esdf_max_distance_m": self.esdf_max_distance_m,
            "esdf_voxel_size_m": self.esdf_voxel_size_m,
            "max_range_m": self.max_range_m,
            "tsdf_max_weight": self.tsdf_config.max_weight,
            "tsdf_obs_weight": self.tsdf_config.obs_weight,
            "occupancy": {k: getattr(self.occupancy_config, k) for k in OCCUPANCY_FIELDS},
            "registration": dict(self.registration),
            "keep_radius_m": self.keep_radius_m,
            **({"shard": self.shard.to_dict()} if self.shard is not None else {}),
        }
