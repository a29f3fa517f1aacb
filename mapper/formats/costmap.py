"""A 2D cost grid for planners from an ESDF slice, as ROS' ``nav_msgs/msg/OccupancyGrid`` (what Nav2 reads).

Cost per cell from the slice's distance ``d`` (metres) to the nearest obstacle:

* ``-1`` where the slice is unknown (NaN);
* ``100`` (lethal) where ``d <= lethal_m`` (inside obstacles, ``d < 0``, included);
* ``0`` (free) where ``d >= inflation_m``;
* in between, falling linearly: ``round(100 * (inflation_m - d) / (inflation_m - lethal_m))``.

Cells are row-major with row 0 at the lowest y, as in the slice; the grid's origin is the slice's
``origin_xy`` (the corner of cell (0, 0)) at height ``z_m``, in frame ``world``. :func:`occupancy_grid_cdr`
serialises the message as ROS 2 CDR (``rosbags``); :mod:`mapper.foxglove` logs it on the
``/maps/<map>/costmap`` channel (schema encoding ``ros2msg``, message encoding ``cdr``) of the live Foxglove
server and of the MCAP export, where Foxglove draws it as a map and ``ros2 bag`` tools read it.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidArgument

MSG_TYPE = "nav_msgs/msg/OccupancyGrid"
UNKNOWN, FREE, LETHAL = -1, 0, 100


def cost_from_distance(distance_m, lethal_m: float = 0.2, inflation_m: float = 1.0) -> np.ndarray:
    """int8 ``[H, W]`` costs (see the module docstring) of float ``[H, W]`` distances (NaN = unknown)."""
    d = np.asarray(distance_m, dtype=np.float64)
    if d.ndim != 2:
        raise InvalidArgument(f"distance_m: expected a [H, W] array, got shape {list(d.shape)}")
    if not (math.isfinite(lethal_m) and math.isfinite(inflation_m) and 0 <= lethal_m < inflation_m):
        raise InvalidArgument(
            f"lethal_m, inflation_m: expected 0 <= lethal_m < inflation_m, got {lethal_m}, {inflation_m}"
        )
    t = np.clip((inflation_m - d) / (inflation_m - lethal_m), 0.0, 1.0)
    cost = np.rint(100.0 * np.nan_to_num(t)).astype(np.int8)
    cost[np.isnan(d)] = UNKNOWN
    return cost


def _typestore():
    # lazy: rosbags (large) loads only when a ROS message is built
    from rosbags.typesys import Stores, get_typestore

    return get_typestore(Stores.ROS2_HUMBLE)


def message_definition() -> str:
    """The ``ros2msg`` schema text of ``nav_msgs/msg/OccupancyGrid`` with its dependencies (MCAP schemas)."""
    return _typestore().generate_msgdef(MSG_TYPE, ros_version=2)[0]


def occupancy_grid_cdr(
    cost: np.ndarray, origin_xy, resolution_m: float, z_m: float, t_s: float = 0.0, frame_id: str = "world"
) -> bytes:
    """A ``nav_msgs/msg/OccupancyGrid`` of int8 ``[H, W]`` ``cost`` as ROS 2 CDR bytes."""
    ts = _typestore()
    T = ts.types
    cost = np.ascontiguousarray(np.asarray(cost, dtype=np.int8))
    h, w = cost.shape
    sec = int(math.floor(t_s))
    stamp = T["builtin_interfaces/msg/Time"](sec=sec, nanosec=int((t_s - sec) * 1e9))
    pose = T["geometry_msgs/msg/Pose"](
        position=T["geometry_msgs/msg/Point"](x=float(origin_xy[0]), y=float(origin_xy[1]), z=float(z_m)),
        orientation=T["geometry_msgs/msg/Quaternion"](x=0.0, y=0.0, z=0.0, w=1.0),
    )
    info = T["nav_msgs/msg/MapMetaData"](
        map_load_time=stamp, resolution=float(resolution_m), width=w, height=h, origin=pose
    )
    msg = T[MSG_TYPE](
        header=T["std_msgs/msg/Header"](stamp=stamp, frame_id=frame_id), info=info, data=cost.reshape(-1)
    )
    return bytes(ts.serialize_cdr(msg, MSG_TYPE))


def decode_occupancy_grid(data: bytes):
    """The ``nav_msgs/msg/OccupancyGrid`` message (a rosbags object) of CDR ``data``."""
    return _typestore().deserialize_cdr(data, MSG_TYPE)
