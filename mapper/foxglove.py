"""Maps in Foxglove (the robotics convention), through the ``foxglove-sdk`` package.

Per map, four topics (``<map>`` = the map's name):

* ``/maps/<map>/mesh`` — ``foxglove.SceneUpdate``: one entity per mesh block (id ``block/i_j_k``), its
  triangles as an indexed ``TriangleListPrimitive`` (per-vertex colours when the map has colour, else grey);
  changed blocks replace their entity, removed blocks are deleted; a full mesh starts with a delete-all.
* ``/maps/<map>/esdf_slice`` — ``foxglove.Grid``: the ESDF slice at the latest sensor height, one float32
  field ``distance`` (NaN = unknown), in frame ``world``.
* ``/maps/<map>/tf`` — ``foxglove.FrameTransform``: ``world`` -> ``<map>/sensor`` for every integrated frame.
* ``/maps/<map>/costmap`` — ``nav_msgs/msg/OccupancyGrid`` (ROS 2 CDR): the slice as a planner's cost grid
  (int8, -1 unknown, 0..100 from the distance: :mod:`mapper.formats.costmap`), beside every slice.

:class:`FoxgloveBridge` serves them live on a Foxglove WebSocket server (``mapper serve --foxglove-port``):
it polls the service's maps and publishes mesh deltas (``since_version``) as frames arrive; a client that
subscribes gets the whole mesh on the next tick. :func:`write_mcap` writes the same messages to an MCAP file
(``mapper export --mcap``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path

import numpy as np

from . import errors, io, wire
from .errors import MapperError
from .formats import costmap
from .mesh import Mesh
from .viewer import split_blocks

log = logging.getLogger("mapper.foxglove")
WORLD = "world"
GREY = (0.7, 0.7, 0.72, 1.0)


def _fg():
    try:
        import foxglove
        from foxglove import messages
    except ImportError as e:  # an optional dependency
        raise RuntimeError("Foxglove output needs the foxglove-sdk package (pip install foxglove-sdk)") from e
    return foxglove, messages


def _ts(t_s: float):
    _, msg = _fg()
    sec = int(math.floor(t_s))
    return msg.Timestamp(sec, int((t_s - sec) * 1e9))


def topics(map_name: str) -> dict[str, str]:
    base = f"/maps/{map_name}"
    t = {"mesh": f"{base}/mesh", "slice": f"{base}/esdf_slice", "tf": f"{base}/tf"}
    return t | {"costmap": f"{base}/costmap"}


def block_id(ijk) -> str:
    return "block/{}_{}_{}".format(*(int(x) for x in ijk))


def mesh_scene_update(mesh: Mesh, t_s: float = 0.0):
    """A ``SceneUpdate`` for a full mesh or a delta (see the module docstring)."""
    _, msg = _fg()
    gv, voff, local, foff = split_blocks(mesh)
    v = mesh.vertices.detach().cpu().numpy()[gv].astype(np.float64)
    col = None if mesh.colors is None else mesh.colors.detach().cpu().numpy()[gv].astype(np.float64) / 255
    ts = _ts(t_s)
    deletions = []
    if mesh.full:
        deletions.append(msg.SceneEntityDeletion(timestamp=ts, type=msg.SceneEntityDeletionType.All))
    for b in mesh.removed_blocks.detach().cpu().numpy():
        deletions.append(msg.SceneEntityDeletion(timestamp=ts, id=block_id(b)))
    entities = []
    for b, ijk in enumerate(mesh.blocks.detach().cpu().numpy()):
        v0, v1 = int(voff[b]), int(voff[b + 1])
        pts = [msg.Point3(x=x, y=y, z=z) for x, y, z in v[v0:v1].tolist()]
        kw = {"color": msg.Color(r=GREY[0], g=GREY[1], b=GREY[2], a=GREY[3])}
        if col is not None:
            kw = {"colors": [msg.Color(r=r, g=g, b=bb, a=1.0) for r, g, bb in col[v0:v1].tolist()]}
        tri = msg.TriangleListPrimitive(
            points=pts, indices=local[int(foff[b]) : int(foff[b + 1])].reshape(-1).tolist(), **kw
        )
        entities.append(msg.SceneEntity(timestamp=ts, frame_id=WORLD, id=block_id(ijk), triangles=[tri]))
    return msg.SceneUpdate(deletions=deletions, entities=entities)


def slice_grid(distance: np.ndarray, origin_xy, resolution_m: float, z_m: float, t_s: float = 0.0):
    """A ``Grid`` of an ESDF slice: ``distance`` float32 ``[H, W]`` (row 0 = lowest y, NaN = unknown)."""
    _, msg = _fg()
    d = np.ascontiguousarray(np.asarray(distance, dtype="<f4"))
    h, w = d.shape
    pose = msg.Pose(
        position=msg.Vector3(x=float(origin_xy[0]), y=float(origin_xy[1]), z=float(z_m)),
        orientation=msg.Quaternion(x=0.0, y=0.0, z=0.0, w=1.0),
    )
    field = msg.PackedElementField(name="distance", offset=0, type=msg.PackedElementFieldNumericType.Float32)
    return msg.Grid(
        timestamp=_ts(t_s),
        frame_id=WORLD,
        pose=pose,
        column_count=w,
        cell_size=msg.Vector2(x=float(resolution_m), y=float(resolution_m)),
        row_stride=4 * w,
        cell_stride=4,
        fields=[field],
        data=d.tobytes(),
    )


def quaternion(R: np.ndarray) -> tuple[float, float, float, float]:
    """(x, y, z, w) of a rotation matrix (Shepperd's method)."""
    R = np.asarray(R, dtype=np.float64)
    t = np.trace(R)
    if t > 0:
        s = 2 * math.sqrt(1 + t)
        return ((R[2, 1] - R[1, 2]) / s, (R[0, 2] - R[2, 0]) / s, (R[1, 0] - R[0, 1]) / s, s / 4)
    i = int(np.argmax(np.diag(R)))
    j, k = (i + 1) % 3, (i + 2) % 3
    s = 2 * math.sqrt(max(1 + R[i, i] - R[j, j] - R[k, k], 1e-300))
    q = [0.0, 0.0, 0.0, 0.0]
    q[i] = s / 4
    q[j] = (R[j, i] + R[i, j]) / s
    q[k] = (R[k, i] + R[i, k]) / s
    q[3] = (R[k, j] - R[j, k]) / s
    return tuple(q)


def sensor_transform(T_world_sensor: np.ndarray, map_name: str, t_s: float = 0.0):
    """A ``FrameTransform`` ``world`` -> ``<map>/sensor``."""
    _, msg = _fg()
    T = np.asarray(T_world_sensor, dtype=np.float64).reshape(4, 4)
    x, y, z, w = quaternion(T[:3, :3])
    return msg.FrameTransform(
        timestamp=_ts(t_s),
        parent_frame_id=WORLD,
        child_frame_id=f"{map_name}/sensor",
        translation=msg.Vector3(x=float(T[0, 3]), y=float(T[1, 3]), z=float(T[2, 3])),
        rotation=msg.Quaternion(x=x, y=y, z=z, w=w),
    )


class MapChannels:
    """The four channels of one map in a foxglove context."""

    def __init__(self, map_name: str, context):
        fg, _ = _fg()
        from foxglove import channels as ch

        t = topics(map_name)
        self.name = map_name
        self.mesh = ch.SceneUpdateChannel(t["mesh"], context=context)
        self.slice = ch.GridChannel(t["slice"], context=context)
        self.tf = ch.FrameTransformChannel(t["tf"], context=context)
        self.costmap = costmap_channel(t["costmap"], context)

    def ids(self) -> set[int]:
        return {self.mesh.id(), self.slice.id(), self.tf.id(), self.costmap.id()}

    def log_slice(self, distance, origin_xy, resolution_m: float, z_m: float, t_s: float, **kw) -> None:
        """The ESDF slice as a Grid and as the planner's cost grid (mapper.formats.costmap)."""
        self.slice.log(slice_grid(distance, origin_xy, resolution_m, z_m, t_s), **kw)
        cost = costmap.cost_from_distance(distance)
        self.costmap.log(costmap.occupancy_grid_cdr(cost, origin_xy, resolution_m, z_m, t_s), **kw)

    def close(self) -> None:
        for c in (self.mesh, self.slice, self.tf, self.costmap):
            c.close()


def costmap_channel(topic: str, context):
    """A ``nav_msgs/msg/OccupancyGrid`` channel (ROS 2 CDR; see mapper.formats.costmap)."""
    fg, _ = _fg()
    schema = fg.Schema(name=costmap.MSG_TYPE, encoding="ros2msg", data=costmap.message_definition().encode())
    return fg.Channel(topic, schema=schema, message_encoding="cdr", context=context)


def write_mcap(path, map_name: str, mesh: Mesh | None, poses=(), slice_=None) -> Path:
    """Write a map's messages (the mesh as one full SceneUpdate, every sensor pose as a FrameTransform, the
    ESDF slice as a Grid) to an MCAP file. ``poses``: ``[N, 4, 4]`` ``T_world_sensor``; ``slice_``: a
    ``(distance [H, W], origin_xy, resolution_m, z_m)`` tuple or None."""
    fg, _ = _fg()
    path = Path(path)
    ctx = fg.Context()
    with fg.open_mcap(path, allow_overwrite=True, context=ctx):
        chans = MapChannels(map_name, ctx)
        for i, T in enumerate(np.asarray(poses, dtype=np.float64).reshape(-1, 4, 4)):
            chans.tf.log(sensor_transform(T, map_name, i * 0.1), log_time=int(i * 1e8))
        t_end = max(len(poses) - 1, 0) * 0.1
        if mesh is not None:
            chans.mesh.log(mesh_scene_update(mesh, t_end), log_time=int(t_end * 1e9))
        if slice_ is not None:
            chans.log_slice(*slice_, t_s=t_end, log_time=int(t_end * 1e9))
    return path


def export_map(m, map_name: str, path, z_m: float | None = None) -> Path:
    """:func:`write_mcap` of a :class:`~mapper.Map`: its mesh (if it has a TSDF), trajectory and the ESDF
    slice at ``z_m`` (default: the last sensor height; none without an ESDF)."""
    poses = m.trajectory()[0].numpy()
    mesh = m.mesh() if "tsdf" in m.layers else None
    sl = None
    z = z_m if z_m is not None else (float(poses[-1, 2, 3]) if len(poses) else None)
    if "esdf" in m.layers and z is not None:
        try:
            s = m.esdf_slice(z)
            sl = (s.distance.cpu().numpy(), s.origin_xy, s.resolution_m, z)
        except MapperError:
            sl = None
    return write_mcap(path, map_name, mesh, poses, sl)


def export_server_map(client, map_id: str, map_name: str, path, z_m: float | None = None) -> Path:
    """:func:`write_mcap` of a map on a running service (through ``mapper.client.MapperClient``)."""
    layers = client.get_map(map_id)["config"]["layers"]
    r = client._request("GET", f"/v1/maps/{map_id}/trajectory")
    poses = np.asarray(r.json()["T_world_sensor"], dtype=np.float64).reshape(-1, 4, 4)
    mesh = None
    if "tsdf" in layers:
        raw = client._request("GET", f"/v1/maps/{map_id}/mesh", params={"format": "msgpack"}).content
        mesh = io.mesh_from_msgpack_dict(wire.unpackb(raw))
    sl = None
    z = z_m if z_m is not None else (float(poses[-1, 2, 3]) if len(poses) else None)
    if "esdf" in layers and z is not None:
        try:
            s = client.esdf_slice(map_id, z)
            sl = (np.asarray(s.distance), s.origin_xy, s.resolution_m, z)
        except MapperError:  # the client's ApiError: no ESDF yet
            sl = None
    return write_mcap(path, map_name, mesh, poses, sl)


class FoxgloveBridge:
    """Publishes a :class:`~mapper.api.service.MapService`'s maps on a Foxglove WebSocket server.

    ``run()`` (an asyncio task) polls every ``interval_s``: per map, the mesh delta since the last published
    version (the whole mesh for a new map or after a subscription), new sensor poses, and the ESDF slice at
    the latest sensor height when the map changed (at most every ``slice_interval_s``). Map reads go
    through the service's read path (``entry.read``), between the writer's batches."""

    def __init__(
        self,
        service,
        host: str = "127.0.0.1",
        port: int = 8765,
        interval_s: float = 0.5,
        slice_interval_s: float = 2.0,
    ):
        fg, _ = _fg()
        self.service = service
        self.interval_s = interval_s
        self.slice_interval_s = slice_interval_s
        self.context = fg.Context()
        self.maps: dict[str, dict] = {}  # map id -> {"chans", "mesh_version", "poses", "slice_t", ...}
        self.server = fg.start_server(
            name="mapper", host=host, port=port, context=self.context, server_listener=self
        )
        self.port = self.server.port
        self._stop = False
        self._logged: dict[str, float] = {}  # error line -> when it was last logged (_log_failure)

    # foxglove ServerListener: a new subscriber gets everything on the next tick
    def on_subscribe(self, client, channel) -> None:
        for st in list(self.maps.values()):
            if channel.id in st["chans"].ids():
                st["mesh_version"] = None
                st["poses"] = 0
                st["slice_version"] = None
                st["subscribed"] = st.get("subscribed", 0) + 1  # a publish in progress must not undo this

    def on_unsubscribe(self, client, channel) -> None:
        pass

    async def run(self) -> None:
        while not self._stop:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except (
                errors.Unavailable
            ) as e:  # the service restores maps (or stops): wait, no log line per tick
                log.debug("foxglove bridge: %s", e)
            except Exception as e:  # a map being deleted, a transient error: the next tick retries
                self._log_failure(e)
            await asyncio.sleep(self.interval_s)

    def _log_failure(self, e: Exception, every_s: float = 60.0) -> None:
        """One warning line per distinct error and at most one per ``every_s`` (the traceback at debug
        level): a failure that repeats every tick must not flood the log."""
        now, key = time.monotonic(), f"{type(e).__name__}: {e}"
        last = self._logged.get(key)
        if last is None or now - last >= every_s:
            self._logged[key] = now
            log.warning("foxglove bridge: publishing failed (%s); retrying", key)
        log.debug("foxglove bridge: publishing failed", exc_info=e)

    async def tick(self) -> None:
        loop = asyncio.get_running_loop()
        live = {e.id: e for e in self.service.list()}
        for map_id in set(self.maps) - set(live):
            self.maps.pop(map_id)["chans"].close()
        for map_id, entry in live.items():
            st = self.maps.get(map_id)
            if st is None:
                st = self.maps[map_id] = {
                    "chans": MapChannels(entry.name, self.context),
                    "mesh_version": None,
                    "poses": 0,
                    "slice_version": None,
                    "slice_t": -1e9,
                    "z": None,
                }
            await self._publish(entry, st, loop)

    async def _publish(self, entry, st, loop) -> None:
        chans, name = st["chans"], entry.name
        now = loop.time()
        layers = entry.map.layers
        gen = st.get("subscribed", 0)  # on_subscribe (another thread) may reset st while we await a read

        def current() -> bool:
            return st.get("subscribed", 0) == gen

        if "tsdf" in layers:
            since = st["mesh_version"]
            mesh = await entry.read(lambda m: m.mesh(since_version=since))
            if mesh.full or mesh.blocks.shape[0] or mesh.removed_blocks.shape[0]:
                update = await asyncio.to_thread(mesh_scene_update, mesh, now)
                chans.mesh.log(update)
            if not current():
                return  # a new subscriber: the next tick sends everything
            st["mesh_version"] = mesh.version
        start = st["poses"]
        T, _, first = await entry.read(lambda m: m.trajectory(start))
        for pose in T.numpy():
            chans.tf.log(sensor_transform(pose, name, now))
            st["z"] = float(pose[2, 3])
        if not current():
            return
        st["poses"] = first + T.shape[0]
        version = entry.view.version  # the published version (what the reads here see)
        if (
            "esdf" in layers
            and version != st["slice_version"]
            and st["z"] is not None
            and now - st["slice_t"] >= self.slice_interval_s
        ):
            z = st["z"]
            limit = entry.settings.max_slice_cells
            try:
                s = await entry.read(lambda m: m.esdf_slice(z, max_pixels=limit), esdf=True)
            except MapperError:  # no ESDF yet, or a slice over the limit: nothing to show
                if current():
                    st["slice_version"], st["slice_t"] = version, now
                return
            chans.log_slice(s.distance.cpu().numpy(), s.origin_xy, s.resolution_m, z, now)
            if current():
                st["slice_version"], st["slice_t"] = version, now

    def stop(self) -> None:
        self._stop = True
        for st in self.maps.values():
            st["chans"].close()
        self.server.stop()
