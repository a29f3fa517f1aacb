"""Prometheus metrics of one app instance (its own registry, so several apps can live in one process).

Per-map series carry ``map`` (the id) and ``name`` (the map's name, so dashboards and alerts read
``name="lab"``); the service registers each map's name in ``Metrics.map_names`` and the per-map metrics
fill the ``name`` label from it (``metric.labels(map_id, ...)`` as before)."""

from __future__ import annotations

import platform
import sys
import time

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily

from .. import __version__


class _PerMap:
    """A labelled metric whose first two labels are ``map`` and ``name``: ``labels(map_id, *rest)`` adds
    the name registered for ``map_id`` (the id itself until one is)."""

    def __init__(self, metric, names: dict[str, str]):
        self.metric, self.names = metric, names

    def labels(self, map_id: str, *rest: str):
        return self.metric.labels(map_id, self.names.get(map_id, map_id), *rest)

    def remove_map(self, map_id: str) -> None:
        for labels in list(self.metric._metrics):  # prometheus_client has no public "labels of" accessor
            if labels and labels[0] == map_id:
                self.metric.remove(*labels)


STAGE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """Every metric the service exports. Thread-safe (prometheus_client is)."""

    def __init__(self, service_stats=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.map_names: dict[str, str] = {}
        names = self.map_names

        def per_map(cls, name: str, doc: str, labels=(), **kw) -> _PerMap:
            return _PerMap(cls(name, doc, ["map", "name", *labels], registry=r, **kw), names)

        Info("mapper_build", "Version of mapper and its main dependencies", registry=r).info(
            {
                "version": __version__,
                "python": platform.python_version(),
                "torch": torch.__version__,
                "cuda": str(torch.version.cuda or "none"),
                "platform": sys.platform,
            }
        )
        self.frames = per_map(Counter, "mapper_frames", "Frames integrated", ["kind"])
        self.points = per_map(Counter, "mapper_points", "Points (pixels) per frame", ["result"])
        self.last_frame = per_map(
            Gauge, "mapper_last_frame_timestamp_seconds", "Unix time the map's last frame was integrated"
        )
        self.registration_fitness = per_map(
            Gauge,
            "mapper_registration_fitness",
            "ICP fitness (inlier fraction) of the map's last frame registered without a pose",
        )
        self.registration_rmse = per_map(
            Gauge,
            "mapper_registration_rmse_meters",
            "ICP inlier RMSE of the last frame registered without a pose",
        )
        self.registration_fitness_hist = Histogram(
            "mapper_registration_fitness_ratio",
            "ICP fitness of frames registered without a pose (all maps)",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0),
            registry=r,
        )
        self.quarantined = per_map(
            Counter,
            "mapper_wal_quarantined_records",
            "WAL records that failed on replay and were kept aside (maps/<id>/quarantine/)",
        )
        self.storage_damage = per_map(
            Counter,
            "mapper_storage_damage",
            "Damage found on recovery and quarantined: damaged WAL byte ranges (kind=wal) and snapshots "
            "(kind=snapshot) (maps/<id>/quarantine/)",
            ["kind"],
        )
        self.map_failed = per_map(
            Gauge,
            "mapper_map_failed",
            "1 while a map is failed: stage=recovery (not served, left on disk), stage=snapshot (served; its "
            "snapshots fail and are retried, the WAL keeps growing)",
            ["stage"],
        )
        self.snapshot_failures = per_map(Counter, "mapper_snapshot_failures", "Snapshot writes that failed")
        self.frame_errors = Counter("mapper_frame_errors", "Frames rejected", ["reason"], registry=r)
        self.stage = Histogram(
            "mapper_stage_seconds",
            "Per-stage integration latency (grow, merge, inject, update, esdf, mesh, ...)",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.integrate = Histogram(
            "mapper_integrate_seconds",
            "Integration time per frame",
            ["kind"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.ack = Histogram(
            "mapper_ack_seconds",
            "Frame accepted -> acknowledged (queue + WAL + integration)",
            ["transport"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.wal_sync = Histogram(
            "mapper_wal_fsync_seconds", "WAL append + fsync per batch", buckets=STAGE_BUCKETS, registry=r
        )
        self.batch = Histogram(
            "mapper_batch_frames", "Operations per writer batch", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.query = Histogram(
            "mapper_query_seconds", "Query latency", ["kind"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.snapshot = Histogram(
            "mapper_snapshot_seconds", "Snapshot write time", buckets=LATENCY_BUCKETS, registry=r
        )
        self.http = Histogram(
            "mapper_http_request_duration_seconds",
            "HTTP request latency",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = per_map(Gauge, "mapper_queue_depth", "Operations waiting for the map's writer")
        self.voxels = per_map(Gauge, "mapper_active_voxels", "Active voxels per layer", ["layer"])
        self.layer_bytes = per_map(Gauge, "mapper_layer_bytes", "Bytes per layer", ["layer"])
        self.maps = Gauge("mapper_maps", "Maps served", registry=r)
        self.ws_connections = Gauge("mapper_ws_connections", "Open WebSocket streams", registry=r)
        # the connection edge (mapper.api.edge): caps and read timeouts
        self.connections = Gauge("mapper_connections", "Open client connections", registry=r)
        self.edge_closed = Counter(
            "mapper_connections_closed_total",
            "Connections refused or closed by the edge (per_client, total, header_timeout, body_timeout)",
            ["reason"],
            registry=r,
        )
        # memory bounds (README "Limits and memory budgets")
        self.map_memory = per_map(Gauge, "mapper_map_memory_bytes", "Bytes a map's layers hold")
        self.map_budget = per_map(Gauge, "mapper_map_memory_budget_bytes", "A map's memory budget")
        self.memory_budget = Gauge(
            "mapper_memory_budget_bytes", "Memory budget of all maps together", registry=r
        )
        self.budget_refusals = per_map(
            Counter,
            "mapper_budget_refusals",
            "Requests refused before allocating: budget=map|process (507), request (413)",
            ["budget"],
        )
        self.map_reloads = per_map(
            Counter,
            "mapper_map_reloads",
            "Maps reloaded from their directory after a WAL failure (the live map = its replay)",
        )
        self.keep_radius = per_map(Gauge, "mapper_keep_radius_m", "A map's keep radius (radius policy)")
        self.radius_cleared = per_map(
            Counter, "mapper_radius_cleared_bricks", "Bricks freed by a map's radius policy"
        )
        # real time (issue 13): per-map latencies, versions and what the read views cost
        self.map_ack = per_map(
            Histogram,
            "mapper_map_ack_seconds",
            "Frame accepted -> acknowledged, per map (queue + WAL + integration + ESDF + publish)",
            ["transport"],
            buckets=LATENCY_BUCKETS,
        )
        self.map_query = per_map(
            Histogram, "mapper_map_query_seconds", "Read latency per map", ["kind"], buckets=LATENCY_BUCKETS
        )
        self.map_version = per_map(Gauge, "mapper_map_version", "The map's last published version")
        self.turn_wait = per_map(
            Histogram,
            "mapper_writer_turn_wait_seconds",
            "A map's writer waiting for its turn (MAPPER_WRITER_SLOTS, round-robin between maps) per batch",
            buckets=LATENCY_BUCKETS,
        )
        self.version_lag = per_map(
            Histogram,
            "mapper_read_version_lag",
            "Versions published while a read ran on its version (0: it read the newest)",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128),
        )
        self.cow_bytes = per_map(
            Counter,
            "mapper_cow_copied_bytes",
            "Bytes of pool pages copied by copy-on-write because a published read view shared them",
        )
        self.publish = Histogram(
            "mapper_publish_seconds", "Publishing a read view per batch", buckets=STAGE_BUCKETS, registry=r
        )
        self.group_commit = Histogram(
            "mapper_group_commit_records",
            "WAL records per fsync (group commit)",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.map_device_memory = per_map(
            Gauge,
            "mapper_map_device_memory_bytes",
            "Bytes a map's layers hold on its device (GPU memory per map on CUDA)",
            ["device"],
        )
        r.register(_GpuMemory())

    def forget_map(self, map_id: str) -> None:
        """Drop the per-map series of a deleted map."""
        for metric in vars(self).values():
            if isinstance(metric, _PerMap):
                metric.remove_map(map_id)
        self.map_names.pop(map_id, None)

    def frame_done(self, map_id: str, registration: dict | None = None) -> None:
        """A frame of ``map_id`` was integrated (``registration``: the ICP statistics of a frame that came
        without a pose)."""
        self.last_frame.labels(map_id).set(time.time())
        if registration:
            fit, rmse = registration.get("fitness"), registration.get("rmse_m")
            if fit is not None:
                self.registration_fitness.labels(map_id).set(float(fit))
                self.registration_fitness_hist.observe(float(fit))
            if rmse is not None:
                self.registration_rmse.labels(map_id).set(float(rmse))

    def set_layer_stats(self, map_id: str, stats: dict) -> None:
        for layer, s in stats.get("layers", {}).items():
            if "voxels" in s:
                self.voxels.labels(map_id, layer).set(s["voxels"])
            if "bytes" in s:
                self.layer_bytes.labels(map_id, layer).set(s["bytes"])


class _GpuMemory:
    """GPU memory per device (collected at scrape time; nothing without CUDA)."""

    def describe(self):
        return []

    def collect(self):
        alloc = GaugeMetricFamily(
            "mapper_gpu_memory_allocated_bytes", "torch allocated bytes", labels=["device"]
        )
        res = GaugeMetricFamily("mapper_gpu_memory_reserved_bytes", "torch reserved bytes", labels=["device"])
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i in range(torch.cuda.device_count()):
                alloc.add_metric([f"cuda:{i}"], torch.cuda.memory_allocated(i))
                res.add_metric([f"cuda:{i}"], torch.cuda.memory_reserved(i))
        yield alloc
        yield res
