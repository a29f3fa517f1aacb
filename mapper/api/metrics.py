"""Prometheus metrics of one app instance (its own registry, so several apps can live in one process)."""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

STAGE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """Every metric the service exports. Thread-safe (prometheus_client is)."""

    def __init__(self, service_stats=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.frames = Counter("mapper_frames", "Frames integrated", ["map", "kind"], registry=r)
        self.points = Counter("mapper_points", "Points (pixels) per frame", ["map", "result"], registry=r)
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
        self.queue_depth = Gauge(
            "mapper_queue_depth", "Operations waiting for the map's writer", ["map"], registry=r
        )
        self.voxels = Gauge("mapper_active_voxels", "Active voxels per layer", ["map", "layer"], registry=r)
        self.layer_bytes = Gauge("mapper_layer_bytes", "Bytes per layer", ["map", "layer"], registry=r)
        self.maps = Gauge("mapper_maps", "Maps served", registry=r)
        self.ws_connections = Gauge("mapper_ws_connections", "Open WebSocket streams", registry=r)
        # memory bounds (README "Limits and memory budgets")
        self.map_memory = Gauge("mapper_map_memory_bytes", "Bytes a map's layers hold", ["map"], registry=r)
        self.map_budget = Gauge(
            "mapper_map_memory_budget_bytes", "A map's memory budget", ["map"], registry=r
        )
        self.memory_budget = Gauge(
            "mapper_memory_budget_bytes", "Memory budget of all maps together", registry=r
        )
        self.budget_refusals = Counter(
            "mapper_budget_refusals",
            "Requests refused before allocating: budget=map|process (507), request (413)",
            ["map", "budget"],
            registry=r,
        )
        self.keep_radius = Gauge(
            "mapper_keep_radius_m", "A map's keep radius (radius policy)", ["map"], registry=r
        )
        self.radius_cleared = Counter(
            "mapper_radius_cleared_bricks", "Bricks freed by a map's radius policy", ["map"], registry=r
        )
        r.register(_GpuMemory())

    def forget_map(self, map_id: str) -> None:
        """Drop the per-map series of a deleted map."""
        per_map = (self.queue_depth, self.voxels, self.layer_bytes, self.frames, self.points, self.map_memory)
        per_map += (self.map_budget, self.budget_refusals, self.keep_radius, self.radius_cleared)
        for metric in per_map:
            for labels in list(metric._metrics):  # prometheus_client has no public "labels of" accessor
                if labels and labels[0] == map_id:
                    metric.remove(*labels)

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
