"""A Python client for the mapping service (robot side): numpy in, numpy out.

    from mapper.client import MapperClient

    with MapperClient("http://127.0.0.1:8000", token="...") as c:
        m = c.create_map(name="lab", voxel_size_m=0.1, layers=["tsdf", "esdf"])
        ack = c.send_lidar(m["id"], points_sensor, T_world_sensor)          # one frame over HTTP
        ack = c.send_lidar(m["id"], points_sensor)      # no pose: the map registers it; ack_pose(ack) = 4x4
        with c.stream(m["id"]) as s:                                         # many, over WebSocket
            for pts, T in scans:
                s.send_lidar(pts, T)
        d, grad, observed = c.query_distance(m["id"], points_world)
        png = c.esdf_slice_png(m["id"], z=0.5)

Errors come back as :class:`ApiError` (a ``MapperError``) with ``status``, ``type`` and ``detail``.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgpack
import numpy as np

from . import wire
from .errors import InvalidArgument, InvalidArgumentType, MapperError


class ApiError(MapperError):
    """An error response of the service."""

    def __init__(self, status: int, type: str, detail: str):
        super().__init__(f"{status} {type}: {detail}")
        self.status, self.type, self.detail = status, type, detail


@dataclass
class SliceResult:
    distance: np.ndarray  # float32 [H, W], NaN = unknown; row 0 = lowest y
    origin_xy: tuple[float, float]  # world x, y of the lower corner (metres)
    resolution_m: float
    z_m: float


def decode_arrays(obj):
    """Wire arrays (``{"dtype", "shape", "data"}``) inside a decoded message -> numpy arrays."""
    if isinstance(obj, dict):
        if "dtype" in obj and "data" in obj and isinstance(obj.get("data"), (bytes, bytearray)):
            return np.frombuffer(obj["data"], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
        return {k: decode_arrays(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_arrays(v) for v in obj]
    return obj


def ack_pose(ack: dict) -> np.ndarray | None:
    """The pose a LiDAR frame's ack reports (the one sent, or the map's estimate) as float64 ``[4, 4]``."""
    T = ack.get("T_world_sensor")
    return None if T is None else np.asarray(T, dtype=np.float64).reshape(4, 4)


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        body = resp.json()
        raise ApiError(resp.status_code, body.get("type", "error"), body.get("detail", resp.text))
    except (ValueError, AttributeError):
        raise ApiError(resp.status_code, "error", resp.text[:500]) from None


class MapperClient:
    """Synchronous client. ``url`` is the service's base URL; ``token`` a bearer token (if required)."""

    def __init__(self, url: str = "http://127.0.0.1:8000", token: str | None = None, timeout: float = 120.0):
        self.url = url.rstrip("/")
        self.token = token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MapperClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------------------------- plumbing
    def _request(self, method: str, path: str, *, busy_retries: int = 100, **kw) -> httpx.Response:
        delay = 0.01
        for _ in range(busy_retries + 1):
            resp = self._http.request(method, path, **kw)
            if resp.status_code not in (429, 503) or _ == busy_retries:
                break
            time.sleep(delay)  # queue full / restoring: back off
            delay = min(delay * 2, 1.0)
        _raise_for(resp)
        return resp

    def _msgpack(self, method: str, path: str, payload: dict | None = None, **kw):
        headers = {"Accept": wire.MSGPACK}
        content = None
        if payload is not None:
            headers["Content-Type"] = wire.MSGPACK
            content = wire.packb(payload)
        resp = self._request(method, path, content=content, headers=headers, **kw)
        return decode_arrays(msgpack.unpackb(resp.content, raw=False))

    # ------------------------------------------------------------------------------------ health
    def health(self) -> dict:
        return self._request("GET", "/healthz").json()

    def ready(self) -> bool:
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url} not ready after {timeout} s")
            time.sleep(0.1)

    def metrics(self) -> str:
        return self._request("GET", "/metrics").text

    # -------------------------------------------------------------------------------------- maps
    def create_map(
        self, name: str | None = None, voxel_size_m: float | None = None, layers=None, **params
    ) -> dict:
        """Create a map; ``params``: truncation_vox, esdf_max_distance_m, max_range_m, tsdf_max_weight,
        tsdf_obs_weight, occupancy (dict), registration (dict, for frames without a pose). Returns its
        summary (``["id"]``)."""
        body = {
            "name": name,
            "voxel_size_m": voxel_size_m,
            "layers": list(layers) if layers else None,
            **params,
        }
        return self._request("POST", "/v1/maps", json={k: v for k, v in body.items() if v is not None}).json()

    def list_maps(self) -> list[dict]:
        return self._request("GET", "/v1/maps").json()["maps"]

    def get_map(self, map_id: str) -> dict:
        return self._request("GET", f"/v1/maps/{map_id}").json()

    def find_map(self, name: str) -> dict | None:
        return next((m for m in self.list_maps() if m["name"] == name), None)

    def delete_map(self, map_id: str) -> None:
        self._request("DELETE", f"/v1/maps/{map_id}")

    def clear(self, map_id: str, aabb_min=None, aabb_max=None) -> dict:
        body = (
            {}
            if aabb_min is None
            else {"aabb_min": list(map(float, aabb_min)), "aabb_max": list(map(float, aabb_max))}
        )
        return self._request("POST", f"/v1/maps/{map_id}/clear", json=body).json()

    def clear_outside(self, map_id: str, center_m, radius_m: float) -> dict:
        body = {"keep_center_m": list(map(float, center_m)), "keep_radius_m": float(radius_m)}
        return self._request("POST", f"/v1/maps/{map_id}/clear", json=body).json()

    def decay(self, map_id: str, factor: float = 0.5, threshold: float = 0.05) -> dict:
        return self._request(
            "POST", f"/v1/maps/{map_id}/decay", json={"factor": factor, "threshold": threshold}
        ).json()

    def snapshot(self, map_id: str) -> dict:
        return self._request("POST", f"/v1/maps/{map_id}/snapshot").json()

    def export(self, map_id: str, path: str | Path) -> Path:
        """Download the map's snapshot file to ``path``."""
        path = Path(path)
        with self._http.stream("GET", f"/v1/maps/{map_id}/export") as resp:
            if resp.status_code >= 400:
                resp.read()
                _raise_for(resp)
            with open(path, "wb") as f:
                for chunk in resp.iter_bytes(1 << 20):
                    f.write(chunk)
        return path

    def export_grid(self, map_id: str, path: str | Path, format: str = "vdb", layer: str = "tsdf") -> Path:
        """Download one layer (``"tsdf"`` / ``"esdf"``) as an OpenVDB (``format="vdb"``) or NanoVDB
        (``"nvdb"``) file to ``path``."""
        resp = self._request("GET", f"/v1/maps/{map_id}/export", params={"format": format, "layer": layer})
        path = Path(path)
        path.write_bytes(resp.content)
        return path

    def import_map(self, path_or_bytes: str | Path | bytes, name: str | None = None) -> dict:
        data = path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()
        params = {"name": name} if name else None
        return self._request(
            "POST",
            "/v1/maps/import",
            content=data,
            params=params,
            headers={"Content-Type": "application/octet-stream"},
        ).json()

    # ------------------------------------------------------------------------------------ frames
    def send_frame(self, map_id: str, message: dict) -> dict:
        """POST one wire frame (see :mod:`mapper.wire`); returns the ack. Retries while the queue is full."""
        return self._msgpack("POST", f"/v1/maps/{map_id}/frames", message)

    def send_lidar(
        self, map_id: str, points_sensor, T_world_sensor=None, timestamp=None, frame_id=None
    ) -> dict:
        """``points_sensor`` float ``[N, 3|4]`` in the sensor frame, ``T_world_sensor`` ``[4, 4]`` or None
        (the map registers the scan). The ack's ``"T_world_sensor"`` is the pose used (16 numbers,
        row-major; :func:`ack_pose` makes it 4x4), ``"registration"`` the ICP statistics of an estimate."""
        return self.send_frame(map_id, wire.lidar_message(points_sensor, T_world_sensor, timestamp, frame_id))

    def send_depth(
        self,
        map_id: str,
        depth,
        K,
        T_world_sensor,
        color=None,
        depth_scale=None,
        timestamp=None,
        frame_id=None,
    ) -> dict:
        """``depth`` ``[H, W]`` float metres (or uint16 with ``depth_scale`` units per metre), ``K`` 3x3 or
        [fx, fy, cx, cy], ``T_world_sensor`` camera-to-world (OpenCV axes), ``color`` uint8 ``[H, W, 3]``."""
        msg = wire.depth_message(depth, K, T_world_sensor, color, depth_scale, timestamp, frame_id)
        return self.send_frame(map_id, msg)

    def stream(self, map_id: str, window: int = 8, raise_errors: bool = True) -> FrameStream:
        """A WebSocket stream to the map (use as a context manager); at most ``window`` frames in flight."""
        ws_url = "ws" + self.url[4:] if self.url.startswith("http") else self.url
        return FrameStream(f"{ws_url}/v1/maps/{map_id}/stream", self.token, window, raise_errors)

    # ----------------------------------------------------------------------------------- queries
    def _points(self, points) -> dict:
        p = np.asarray(points)
        if p.ndim == 0 or p.shape[-1] != 3:
            raise InvalidArgument(f"points: expected shape [M, 3] (x, y, z in metres), got {list(p.shape)}")
        if p.dtype.kind not in "fiu":
            raise InvalidArgumentType(f"points: expected numbers, got dtype {p.dtype}")
        if p.dtype not in (np.float32, np.float64):
            p = p.astype(np.float64)
        return {"points": wire.encode_array(p.reshape(-1, 3))}

    def query_distance(self, map_id: str, points) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(distance float32 [M] metres, NaN = unknown; gradient float32 [M, 3]; observed bool [M])."""
        r = self._msgpack("POST", f"/v1/maps/{map_id}/query/distance", self._points(points))
        return r["distance"], r["gradient"], r["observed"].astype(bool)

    def query_occupancy(self, map_id: str, points) -> tuple[np.ndarray, np.ndarray]:
        """(state int8 [M]: -1 unknown, 0 free, 1 occupied; probability float32 [M])."""
        r = self._msgpack("POST", f"/v1/maps/{map_id}/query/occupancy", self._points(points))
        return r["state"].astype(np.int8), r["probability"]

    def query_tsdf(self, map_id: str, points) -> tuple[np.ndarray, np.ndarray]:
        """(tsdf float32 [M] metres, NaN = unobserved; weight float32 [M])."""
        r = self._msgpack("POST", f"/v1/maps/{map_id}/query/tsdf", self._points(points))
        return r["tsdf"], r["weight"]

    def _slice_params(self, z, bounds, resolution_m, fmt) -> dict:
        params = {"z": float(z), "format": fmt}
        if bounds is not None:
            (x0, y0), (x1, y1) = bounds
            params.update(x_min=x0, y_min=y0, x_max=x1, y_max=y1)
        if resolution_m is not None:
            params["resolution_m"] = resolution_m
        return params

    def esdf_slice(
        self, map_id: str, z: float, bounds=None, resolution_m: float | None = None
    ) -> SliceResult:
        """The ESDF on the plane ``z``; ``bounds`` = ((x_min, y_min), (x_max, y_max)) or the map's extent."""
        params = self._slice_params(z, bounds, resolution_m, "msgpack")
        r = decode_arrays(
            msgpack.unpackb(self._request("GET", f"/v1/maps/{map_id}/esdf/slice", params=params).content)
        )
        return SliceResult(r["distance"], tuple(r["origin_xy"]), r["resolution_m"], r["z_m"])

    def esdf_slice_png(self, map_id: str, z: float, bounds=None, resolution_m: float | None = None) -> bytes:
        params = self._slice_params(z, bounds, resolution_m, "png")
        return self._request("GET", f"/v1/maps/{map_id}/esdf/slice", params=params).content

    def esdf_box(self, map_id: str, aabb_min, aabb_max) -> dict:
        """``{"distance" [X, Y, Z], "gradient" [X, Y, Z, 3], "observed" bool, "origin", "resolution_m"}``."""
        body = {"aabb_min": list(map(float, aabb_min)), "aabb_max": list(map(float, aabb_max))}
        resp = self._request(
            "POST", f"/v1/maps/{map_id}/esdf/box", json=body, headers={"Accept": wire.MSGPACK}
        )
        r = decode_arrays(msgpack.unpackb(resp.content, raw=False))
        r["observed"] = r["observed"].astype(bool)
        return r

    def mesh(self, map_id: str, since_version: int | None = None) -> dict:
        """The mesh as numpy arrays: vertices, faces, normals, colors (or None), removed_blocks, version..."""
        params = {"format": "msgpack"}
        if since_version is not None:
            params["since_version"] = since_version
        resp = self._request("GET", f"/v1/maps/{map_id}/mesh", params=params)
        return decode_arrays(msgpack.unpackb(resp.content, raw=False))

    def mesh_ply(self, map_id: str) -> bytes:
        return self._request("GET", f"/v1/maps/{map_id}/mesh", params={"format": "ply"}).content


class FrameStream:
    """Frames over one WebSocket; acks arrive in order. ``send_*`` blocks while ``window`` frames are
    unacknowledged (and the server stops reading when the map's queue is full)."""

    def __init__(self, url: str, token: str | None, window: int = 8, raise_errors: bool = True):
        # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
        from websockets.sync.client import connect

        headers = {"Authorization": f"Bearer {token}"} if token else None
        # no permessage-deflate: float32 points barely compress, and deflating a LiDAR frame costs more
        # than sending it (and the server an inflate per frame on its event loop)
        self._conn = connect(
            url, additional_headers=headers, max_size=None, open_timeout=30, compression=None
        )
        self._ws = self._conn.__enter__()  # websockets >= 17 wants connect() used as a context manager
        self.window = max(1, int(window))
        self.raise_errors = raise_errors
        self.in_flight = 0
        self.acks: list[dict] = []  # every ack and error message received, in order
        self._new: deque = deque()

    def __enter__(self) -> FrameStream:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            if exc_type is None:
                self.flush()
        finally:
            self.close()

    def _recv(self, raise_errors: bool | None = None) -> dict:
        msg = msgpack.unpackb(self._ws.recv(), raw=False)
        self.in_flight -= 1
        self.acks.append(msg)
        self._new.append(msg)
        if "type" in msg and (self.raise_errors if raise_errors is None else raise_errors):
            raise ApiError(msg.get("status", 400), msg["type"], msg.get("detail", ""))
        return msg

    def send(self, message: dict) -> list[dict]:
        """Send one wire frame; returns the acks that arrived while waiting for room in the window.
        When the server closed the stream (a restart closes it with 1012 after acknowledging every frame
        it took), the acks still buffered are read into ``acks`` before ``ConnectionClosed`` is raised:
        the frames without an ack were not taken."""
        # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
        from websockets.exceptions import ConnectionClosed

        while self.in_flight >= self.window:
            self._recv()
        try:
            self._ws.send(wire.packb(message))
        except ConnectionClosed:
            with contextlib.suppress(ConnectionClosed):
                while self.in_flight > 0:
                    self._recv(raise_errors=False)
            raise
        self.in_flight += 1
        out = list(self._new)
        self._new.clear()
        return out

    def send_lidar(self, points_sensor, T_world_sensor=None, timestamp=None, frame_id=None) -> list[dict]:
        """As :meth:`MapperClient.send_lidar` (None: the map registers the scan)."""
        return self.send(wire.lidar_message(points_sensor, T_world_sensor, timestamp, frame_id))

    def send_depth(
        self, depth, K, T_world_sensor, color=None, depth_scale=None, timestamp=None, frame_id=None
    ) -> list[dict]:
        return self.send(
            wire.depth_message(depth, K, T_world_sensor, color, depth_scale, timestamp, frame_id)
        )

    def receive(self) -> dict | None:
        """Wait for the next ack (None when nothing is in flight); it is not returned again by ``send``
        or ``flush``."""
        if self.in_flight <= 0:
            return None
        msg = self._recv()
        self._new.pop()
        return msg

    def flush(self) -> list[dict]:
        """Wait for every outstanding ack; returns the acks not yet returned by ``send``."""
        while self.in_flight > 0:
            self._recv()
        out = list(self._new)
        self._new.clear()
        return out

    def close(self) -> None:
        self._conn.__exit__(None, None, None)
