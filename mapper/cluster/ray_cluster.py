"""Start or join a Ray cluster and run the map workers on it as actors.

``connect_ray(None)`` starts a small local Ray (no dashboard, a small object store: the maps never pass
through it); ``connect_ray("ray://..."/"host:port"/"auto")`` joins an existing cluster. ``start_workers``
creates the actors (``mapper-w<i>`` in the ``mapper`` namespace): one GPU each where the cluster has GPUs
(a share of one when there are more workers than GPUs), else CPU workers. Ray restarts a worker whose
process dies (``max_restarts=-1``); its ``__init__`` then recovers its maps from the shared root.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

from ..errors import InvalidArgument
from .worker import MapWorker

log = logging.getLogger("mapper.cluster")

NAMESPACE = "mapper"
LOCAL_OBJECT_STORE_BYTES = 200 << 20


def require_ray():
    """``import ray`` or raise ``InvalidArgument`` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise InvalidArgument("--ray needs the ray package: pip install 'mapper[ray]'") from None
    return ray


def connect_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Join the Ray cluster at ``address`` or start a local one. Returns True when this call started Ray
    (the caller then shuts it down)."""
    ray = require_ray()
    if ray.is_initialized():
        return False
    kw = dict(namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
    if address:
        ray.init(address=address, **kw)
    else:
        try:
            start_local_ray(num_cpus)
        except ValueError:  # a cluster of `ray start` on this machine was found: join it as it is
            log.info("joining the Ray cluster already running on this machine")
            ray.init(**kw)
    return True


def start_local_ray(num_cpus: int | None = None, namespace: str = NAMESPACE) -> None:
    """Start a small local Ray in this process: ``num_cpus`` CPUs (None: the machine's), no dashboard, a
    200 MiB object store (the maps never pass through it), Ray's logs not forwarded to this process. The
    map workers' actors live in the ``mapper`` namespace whatever ``namespace`` (the job's) is.

    Raises:
        ValueError: (Ray's) a cluster of ``ray start`` runs on this machine (``connect_ray`` then joins it).
    """
    require_ray().init(
        num_cpus=num_cpus,
        object_store_memory=LOCAL_OBJECT_STORE_BYTES,
        include_dashboard=False,
        namespace=namespace,
        log_to_driver=False,
        configure_logging=False,
    )


@dataclass
class WorkerHandle:
    """The ingress's view of one worker: its actor and the last known address of its HTTP server."""

    index: int
    actor: object
    url: str | None = None
    token: str | None = None


def plan_workers(device: str, gpus: float, n: int | None) -> tuple[int, float, float]:
    """``(workers, GPUs per worker, memory share per worker)`` for ``MAPPER_DEVICE`` ``device`` on a
    cluster offering ``gpus`` GPUs now. ``auto`` uses GPUs when there are some (one worker each by
    default, several sharing one when ``n`` exceeds them), else 2 CPU workers; ``cuda[:i]`` always asks
    for GPUs (a whole one each when none has joined yet: the workers wait for GPU nodes, as on a
    KubeRay cluster whose GPU pods start after the head); ``cpu`` never does."""
    device = str(device)
    use_gpu = device.startswith("cuda") or (device == "auto" and gpus > 0)
    if not use_gpu:
        n = n or 2
        return n, 0.0, 1.0 / n
    n = n or max(1, int(gpus))
    per_gpu = min(1.0, gpus / n) if gpus >= 1 else 1.0
    return n, per_gpu, per_gpu


def start_workers(settings, n: int | None = None, token: str | None = None) -> list[WorkerHandle]:
    """Create (or, when they exist in the namespace, reuse) ``n`` map-worker actors on the connected Ray
    cluster, each on ``<settings.data_dir>/workers/w<i>``. ``settings.data_dir`` must be reachable by every
    node (a shared filesystem) for a restarted or moved map to be found, unless ``settings.store`` is an
    object store (then every worker keeps its maps there and ``data_dir`` holds local caches only)."""
    ray = require_ray()
    gpus = float(ray.cluster_resources().get("GPU", 0))
    n, per_gpu, share = plan_workers(settings.device, gpus, n)
    token = token or secrets.token_urlsafe(24)
    root = str(settings.data_dir.resolve())
    values = settings.model_dump(mode="json")
    Actor = ray.remote(MapWorker)
    handles = []
    for i in range(n):
        actor = Actor.options(
            name=f"mapper-w{i}",
            namespace=NAMESPACE,
            get_if_exists=True,
            max_restarts=-1,
            max_task_retries=3,
            max_concurrency=16,
            num_cpus=0,
            num_gpus=per_gpu,
            scheduling_strategy="SPREAD",
        ).remote(i, root, values, token, share)
        handles.append(WorkerHandle(i, actor))
    for h in handles:
        h.url, h.token = ray.get(h.actor.address.remote())
    log.info("%d map workers: %s", n, ", ".join(h.url for h in handles))
    return handles


def stop_workers(handles: list[WorkerHandle], timeout_s: float = 120.0) -> None:
    """Snapshot every map and end the worker actors."""
    ray = require_ray()
    refs = [h.actor.stop.remote() for h in handles]
    try:
        ray.get(refs, timeout=timeout_s)
    except Exception:
        log.exception("stopping the map workers")
    for h in handles:
        ray.kill(h.actor, no_restart=True)
