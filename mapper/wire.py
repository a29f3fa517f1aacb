"""The wire format of the service: msgpack messages carrying numpy arrays, frames and acks.

An array is ``{"dtype": "float32"|"float64"|"uint16"|"uint8"|"int32", "shape": [..], "data": <bin>}``
(little-endian, C order); where JSON is accepted, nested lists stand in for it.

A LiDAR frame: ``{"kind": "lidar", "points": <array [N, 3|4]>, "T_world_sensor": <array [4, 4] or 16
row-major numbers>?, "timestamp": float, "frame_id": str?}``; without ``T_world_sensor`` (or with null) the
map estimates the pose by registering the scan (``Map.integrate_lidar``) and the ack carries the pose it used
(``"T_world_sensor"``: 16 row-major numbers, and ``"registration"``: the ICP statistics). A depth frame:
``{"kind": "depth", "depth": <array [H, W] float32 metres, or uint16 with "depth_scale" units per metre>,
"K": [fx, fy, cx, cy] (or 3x3), "T_world_sensor": ..., "color": <array [H, W, 3] uint8>?, "timestamp":
float}``.

Non-finite values: NaN points / depths mean "no return" and are dropped (counted in ``points_dropped``);
±Inf anywhere, a frame with no finite point, and non-finite poses or query points are rejected.

Everything here is numpy + msgpack; the client imports it without torch work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from ._validation import check_pinhole, check_translation
from .errors import CapacityExceeded, InvalidArgument, InvalidArgumentType

MSGPACK = "application/msgpack"
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")

DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "uint16": np.dtype("<u2"),
    "uint8": np.dtype("u1"),
    "int32": np.dtype("<i4"),
}
INPUT_DTYPES = ("float32", "float64", "uint16", "uint8", "int32")
FLOAT_DTYPES = ("float32", "float64")


class MalformedMessage(InvalidArgument):
    """The body is not a well-formed message (bad msgpack/JSON, not a map) -> HTTP 400."""


class TooLarge(CapacityExceeded):
    """A message exceeds a configured limit (points, pixels, bytes) -> HTTP 413."""


@dataclass(frozen=True)
class Limits:
    """Sizes the decoder refuses to go beyond."""

    max_points: int = 2_000_000
    max_pixels: int = 4_000_000
    max_query_points: int = 1_000_000
    max_translation_m: float = 1e6  # |x|, |y|, |z| of a pose's translation (MAPPER_MAX_POSE_TRANSLATION_M)


# ------------------------------------------------------------------------------------------ msgpack
def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, default=_default)


def _default(obj):
    if isinstance(obj, np.ndarray):
        return encode_array(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def unpackb(data: bytes) -> Any:
    """Decode one msgpack message; malformed input raises :class:`MalformedMessage`."""
    if not data:
        raise MalformedMessage("body: empty")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise MalformedMessage(f"body: malformed msgpack ({type(e).__name__}: {e})") from None
    except Exception as e:  # msgpack raises several private error types for truncated data
        raise MalformedMessage(f"body: malformed msgpack ({type(e).__name__})") from None


# ------------------------------------------------------------------------------------------- arrays
def encode_array(a) -> dict:
    """numpy array (or anything ``np.asarray`` takes) -> wire dict. Outputs keep to the five wire dtypes:
    bool -> uint8, float16 -> float32, other integers -> int32 (values must fit)."""
    a = np.asarray(a)
    kind, size = a.dtype.kind, a.dtype.itemsize
    if kind == "b":
        a = a.astype(np.uint8)
    elif kind == "f":
        a = a.astype("<f8" if size == 8 else "<f4", copy=False)
    elif kind == "u" and size <= 2:
        a = a.astype("u1" if size == 1 else "<u2", copy=False)
    elif kind in "iu":
        if a.size and (a.min() < -(2**31) or a.max() >= 2**31):
            raise InvalidArgument("array: integer values do not fit int32")
        a = a.astype("<i4", copy=False)
    else:
        raise InvalidArgumentType(f"array: dtype {a.dtype} has no wire encoding")
    name = next(k for k, d in DTYPES.items() if d == a.dtype)
    a = np.ascontiguousarray(a)
    return {"dtype": name, "shape": list(a.shape), "data": a.tobytes()}


def is_wire_array(obj) -> bool:
    return isinstance(obj, dict) and "dtype" in obj and "data" in obj


def decode_array(
    obj, name: str, dtypes: tuple[str, ...] = INPUT_DTYPES, max_elements: int | None = None
) -> np.ndarray:
    """A wire array (or nested lists of numbers) -> a writable numpy array.

    Raises ``InvalidArgumentType`` for a dtype outside ``dtypes``, ``InvalidArgument`` for a malformed
    encoding, ``TooLarge`` beyond ``max_elements``.
    """
    if isinstance(obj, dict):
        dt, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
        if not isinstance(dt, str) or dt not in DTYPES:
            raise InvalidArgumentType(f"{name}: dtype must be one of {list(dtypes)}, got {dt!r}")
        if dt not in dtypes:
            raise InvalidArgumentType(f"{name}: dtype must be one of {list(dtypes)}, got {dt!r}")
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise InvalidArgument(f"{name}: shape must be a list of non-negative ints, got {shape!r}")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"{name}: data must be binary (msgpack bin), got {type(data).__name__}")
        count = math.prod(shape)
        if max_elements is not None and count > max_elements:
            raise TooLarge(f"{name}: {count} elements exceed the limit of {max_elements}")
        itemsize = DTYPES[dt].itemsize
        if len(data) != count * itemsize:
            raise InvalidArgument(
                f"{name}: data has {len(data)} bytes, shape {shape} of {dt} needs {count * itemsize}"
            )
        return np.frombuffer(data, dtype=DTYPES[dt]).reshape(shape).copy()
    if isinstance(obj, list):
        if _has_bool(obj):
            raise InvalidArgumentType(f"{name}: expected numbers, got a boolean (true/false)")
        try:
            a = np.asarray(obj)
        except (ValueError, TypeError) as e:
            raise InvalidArgument(f"{name}: ragged or non-numeric nested list ({e})") from None
        if a.dtype == bool or a.dtype.kind not in "iuf":
            raise InvalidArgumentType(f"{name}: expected numbers, got {a.dtype} values")
        if max_elements is not None and a.size > max_elements:
            raise TooLarge(f"{name}: {a.size} elements exceed the limit of {max_elements}")
        if a.dtype.kind in "iu":
            if a.size and (a.max() > np.iinfo(np.int64).max or a.min() < np.iinfo(np.int64).min):
                raise InvalidArgument(f"{name}: integer out of range")
        allowed_float = any(d in FLOAT_DTYPES for d in dtypes)
        if allowed_float:
            return a.astype(np.float64)
        return a
    raise InvalidArgumentType(f"{name}: expected an array map or a list, got {type(obj).__name__}")


def _has_bool(obj: list) -> bool:
    """Whether nested lists hold a bool anywhere (numpy would silently turn ``true`` into 1.0)."""
    stack = [obj]
    while stack:
        for x in stack.pop():
            t = type(x)
            if t is bool:
                return True
            if t is list:
                stack.append(x)
    return False


def _number(obj, name: str, default: float | None = None) -> float | None:
    if obj is None:
        return default
    if isinstance(obj, bool) or not isinstance(obj, (int, float)):
        raise InvalidArgumentType(f"{name}: expected a number, got {type(obj).__name__}")
    x = float(obj)
    if not math.isfinite(x):
        raise InvalidArgument(f"{name}: must be finite, got {obj}")
    return x


def check_pose(obj, name: str = "T_world_sensor", max_translation_m: float | None = None) -> np.ndarray:
    """A rigid transform (``[4, 4]`` array or 16 row-major numbers) -> float64 ``[4, 4]``.

    Refuses other shapes, non-finite values, a rotation block that is not a rotation, a last row other
    than ``[0, 0, 0, 1]`` and (with ``max_translation_m``) a translation component beyond it."""
    if obj is None:
        raise InvalidArgument(f"{name}: required")
    T = decode_array(obj, name, FLOAT_DTYPES + ("int32",), max_elements=16).astype(np.float64)
    if T.shape not in ((4, 4), (16,)):
        raise InvalidArgument(f"{name}: expected shape [4, 4] (or 16 row-major values), got {list(T.shape)}")
    T = T.reshape(4, 4)
    if not np.isfinite(T).all():
        raise InvalidArgument(f"{name}: contains NaN or Inf")
    R = T[:3, :3]
    if not np.allclose(R @ R.T, np.eye(3), atol=1e-3) or np.linalg.det(R) < 0:
        raise InvalidArgument(f"{name}: the rotation block is not a rotation (R R^T != I or det < 0)")
    if not np.allclose(T[3], [0, 0, 0, 1], atol=1e-6):
        raise InvalidArgument(f"{name}: last row must be [0, 0, 0, 1]")
    if max_translation_m is not None:
        check_translation(name, T[:3, 3], max_translation_m, "MAPPER_MAX_POSE_TRANSLATION_M")
    return T


def check_points(obj, name: str, max_points: int, allow_nan: bool) -> np.ndarray:
    """Points ``[N, 3]`` (``[N, 4]`` accepted where ``allow_nan``, i.e. for frames) -> float array."""
    if obj is None:
        raise InvalidArgument(f"{name}: required")
    a = decode_array(obj, name, FLOAT_DTYPES, max_elements=4 * max_points)
    cols = (3, 4) if allow_nan else (3,)
    if a.ndim != 2 or a.shape[1] not in cols:
        want = " or ".join(f"[N, {c}]" for c in cols)
        raise InvalidArgument(f"{name}: expected shape {want}, got {list(a.shape)}")
    if a.shape[0] == 0:
        raise InvalidArgument(f"{name}: empty (no points)")
    if a.shape[0] > max_points:
        raise TooLarge(f"{name}: {a.shape[0]} points exceed the limit of {max_points}")
    xyz = a[:, :3]
    if math.isfinite(float(xyz.sum())):  # one pass: no coordinate is ±Inf or NaN, every check below holds
        return a
    if np.isinf(xyz).any():
        raise InvalidArgument(f"{name}: contains ±Inf (use NaN for no return)")
    if allow_nan:
        if not np.isfinite(xyz).all(axis=1).any():
            raise InvalidArgument(f"{name}: no finite point (every row has a NaN)")
    elif np.isnan(xyz).any():
        raise InvalidArgument(f"{name}: contains NaN")
    return a


# ------------------------------------------------------------------------------------------- frames
@dataclass
class LidarFrame:
    points: np.ndarray  # float32/64 [N, 3|4], sensor frame
    T_world_sensor: np.ndarray | None  # float64 [4, 4]; None: the map registers the scan
    timestamp: float | None = None
    frame_id: str | None = None
    kind: str = "lidar"
    # set by the service, never parsed from a client's frame: T_world_sensor is the map's own estimate
    # (the write-ahead log stores it with the frame so that replay reproduces the map)
    pose_estimated: bool = False

    @property
    def num_points(self) -> int:
        return int(self.points.shape[0])


@dataclass
class DepthFrame:
    depth: np.ndarray  # float32 metres or uint16 units [H, W]
    K: np.ndarray  # float64 [4] (fx, fy, cx, cy) or [3, 3]
    T_world_sensor: np.ndarray
    color: np.ndarray | None = None  # uint8 [H, W, 3]
    depth_scale: float | None = None  # units per metre for uint16 depth
    timestamp: float | None = None
    frame_id: str | None = None
    kind: str = "depth"

    @property
    def depth_m(self) -> np.ndarray:
        if self.depth.dtype == np.uint16:
            return self.depth.astype(np.float32) / np.float32(self.depth_scale)
        return self.depth.astype(np.float32, copy=False)

    @property
    def num_points(self) -> int:
        return int(self.depth.size)


Frame = LidarFrame | DepthFrame


def _frame_id(obj) -> str | None:
    if obj is None:
        return None
    if not isinstance(obj, str) or len(obj) > 256:
        raise InvalidArgumentType("frame_id: expected a string of at most 256 characters")
    return obj


def parse_frame(msg, limits: Limits = Limits()) -> Frame:
    """A decoded message (dict) -> a validated frame. Raises the library's errors naming the field."""
    if not isinstance(msg, dict):
        raise MalformedMessage(f"frame: expected a map, got {type(msg).__name__}")
    kind = msg.get("kind")
    ts = _number(msg.get("timestamp"), "timestamp")
    fid = _frame_id(msg.get("frame_id"))
    if kind == "lidar":
        pts = check_points(msg.get("points"), "points", limits.max_points, allow_nan=True)
        T = msg.get("T_world_sensor")
        T = None if T is None else check_pose(T, max_translation_m=limits.max_translation_m)
        return LidarFrame(pts, T, ts, fid)
    if kind == "depth":
        return _parse_depth(msg, limits, ts, fid)
    raise InvalidArgument(f"kind: expected 'lidar' or 'depth', got {kind!r}")


def _parse_depth(msg: dict, limits: Limits, ts, fid) -> DepthFrame:
    raw = msg.get("depth")
    if raw is None:
        raise InvalidArgument("depth: required")
    depth = decode_array(raw, "depth", ("float32", "float64", "uint16"), max_elements=limits.max_pixels)
    if depth.ndim != 2 or depth.shape[0] == 0 or depth.shape[1] == 0:
        raise InvalidArgument(f"depth: expected shape [H, W], got {list(depth.shape)}")
    if depth.size > limits.max_pixels:
        raise TooLarge(f"depth: {depth.size} pixels exceed the limit of {limits.max_pixels}")
    scale = None
    if depth.dtype == np.uint16:
        scale = _number(msg.get("depth_scale"), "depth_scale")
        if scale is None or scale <= 0:
            raise InvalidArgument("depth_scale: uint16 depth needs depth_scale > 0 (units per metre)")
    else:
        if depth.dtype.kind != "f":
            raise InvalidArgumentType(f"depth: expected float32 metres or uint16, got {depth.dtype}")
        if np.isinf(depth).any():
            raise InvalidArgument("depth: contains ±Inf (use 0 or NaN for no return)")
        depth = depth.astype(np.float32)
    if not (np.nan_to_num(depth, nan=0.0) > 0).any():
        raise InvalidArgument("depth: empty frame (no pixel with a positive depth)")
    K = check_intrinsics(msg.get("K"), depth.shape)
    T = check_pose(msg.get("T_world_sensor"), max_translation_m=limits.max_translation_m)
    color = None
    if msg.get("color") is not None:
        color = decode_array(msg["color"], "color", ("uint8",), max_elements=3 * limits.max_pixels)
        if color.shape != (*depth.shape, 3):
            raise InvalidArgument(
                f"color: expected shape [{depth.shape[0]}, {depth.shape[1]}, 3], got {list(color.shape)}"
            )
        color = color.astype(np.uint8)
    return DepthFrame(depth, K, T, color, scale, ts, fid)


def check_usable(frame: Frame, max_range_m: float, coordinate_limit_m: float) -> None:
    """Refuse (``InvalidArgument``, HTTP 422) a frame that would add nothing to a map with this
    ``max_range_m`` and coordinate range (``Map.coordinate_limit_m``): no return is finite, farther than
    1e-6 m from the sensor and within ``max_range_m`` (LiDAR: also, with a pose, inside the coordinate range;
    depth: after ``depth_scale``). ``Map.integrate_*`` would acknowledge it with ``points_used`` 0; the
    service checks this before the frame is logged, so such a frame never reaches the WAL."""
    if isinstance(frame, LidarFrame):
        xyz = frame.points[:, :3]
        with np.errstate(over="ignore", invalid="ignore"):
            sq = np.einsum("ij,ij->i", xyz, xyz)  # NaN and overflow (|p| ~ 1e20+) fail both comparisons
        ok = (sq > 1e-12) & (sq <= max_range_m * max_range_m)
        if not ok.any():
            raise InvalidArgument(
                f"points: no usable return: all {xyz.shape[0]} points are NaN, within 1e-6 m of the sensor "
                f"or beyond the map's max_range_m of {max_range_m:g} m; nothing would be integrated"
            )
        T = frame.T_world_sensor
        if T is not None and (np.abs(T[:3, 3]) + max_range_m > coordinate_limit_m).any():
            w = xyz[ok].astype(np.float64) @ T[:3, :3].T + T[:3, 3]
            if not (np.abs(w) <= coordinate_limit_m).all(axis=1).any():
                raise InvalidArgument(
                    f"points: no usable return: every point in range lies outside the map's coordinate "
                    f"range of +-{coordinate_limit_m:g} m per axis; nothing would be integrated"
                )
        return
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        d = frame.depth_m
        ok = (d > 0) & (d <= max_range_m)  # NaN and +-Inf fail one of the two
    if not ok.any():
        how = f" after depth_scale {frame.depth_scale:g}" if frame.depth_scale is not None else ""
        raise InvalidArgument(
            f"depth: no usable pixel: every depth{how} is 0, NaN, infinite or beyond the map's max_range_m "
            f"of {max_range_m:g} m; nothing would be integrated"
        )


def check_intrinsics(obj, image_shape: tuple[int, int], name: str = "K") -> np.ndarray:
    """``[fx, fy, cx, cy]`` or a 3x3 pinhole matrix (no skew, last row ``[0, 0, 1]``) for an image of
    ``image_shape`` (H, W) -> float64 ``[4]`` or ``[3, 3]`` as sent; the field of view must be sane
    (``mapper._validation.check_pinhole``)."""
    if obj is None:
        raise InvalidArgument(f"{name}: required")
    K = decode_array(obj, name, FLOAT_DTYPES + ("int32",), max_elements=9).astype(np.float64)
    if K.shape not in ((4,), (3, 3)):
        raise InvalidArgument(f"{name}: expected [fx, fy, cx, cy] or [3, 3], got shape {list(K.shape)}")
    if not np.isfinite(K).all():
        raise InvalidArgument(f"{name}: contains NaN or Inf")
    if K.shape == (3, 3):
        if K[0, 1] != 0 or K[1, 0] != 0 or K[2, 0] != 0 or K[2, 1] != 0 or K[2, 2] != 1:
            raise InvalidArgument(f"{name}: expected [[fx, 0, cx], [0, fy, cy], [0, 0, 1]] (no skew)")
        fx, fy, cx, cy = K[0, 0], K[1, 1], K[0, 2], K[1, 2]
    else:
        fx, fy, cx, cy = K
    check_pinhole(name, float(fx), float(fy), float(cx), float(cy), image_shape[1], image_shape[0])
    return K


def frame_to_wire(frame: Frame) -> dict:
    """A frame -> its wire dict (the inverse of :func:`parse_frame`)."""
    out: dict[str, Any] = {"kind": frame.kind}
    if frame.T_world_sensor is not None:
        out["T_world_sensor"] = encode_array(frame.T_world_sensor)
    if frame.timestamp is not None:
        out["timestamp"] = frame.timestamp
    if frame.frame_id is not None:
        out["frame_id"] = frame.frame_id
    if isinstance(frame, LidarFrame):
        out["points"] = encode_array(frame.points)
    else:
        out["depth"] = encode_array(frame.depth)
        out["K"] = (
            np.asarray(frame.K, dtype=np.float64).reshape(-1).tolist()
            if frame.K.size == 4
            else encode_array(frame.K)
        )
        if frame.depth_scale is not None:
            out["depth_scale"] = frame.depth_scale
        if frame.color is not None:
            out["color"] = encode_array(frame.color)
    return out


def lidar_message(
    points, T_world_sensor=None, timestamp: float | None = None, frame_id: str | None = None
) -> dict:
    """Client side: numpy points ``[N, 3|4]`` (float32 sent as is) + pose (None: the map estimates it)
    -> a wire frame."""
    pts = np.asarray(points)
    if pts.dtype not in (np.float32, np.float64):
        pts = pts.astype(np.float32)
    msg = {"kind": "lidar", "points": encode_array(pts)}
    if T_world_sensor is not None:
        msg["T_world_sensor"] = _pose_wire(T_world_sensor)
    if timestamp is not None:
        msg["timestamp"] = float(timestamp)
    if frame_id is not None:
        msg["frame_id"] = frame_id
    return msg


def depth_message(
    depth,
    K,
    T_world_sensor,
    color=None,
    depth_scale: float | None = None,
    timestamp: float | None = None,
    frame_id: str | None = None,
) -> dict:
    """Client side: depth ``[H, W]`` (float metres, or uint16 with ``depth_scale``) -> a wire frame."""
    d = np.asarray(depth)
    if d.dtype != np.uint16:
        d = d.astype(np.float32)
    K = np.asarray(K, dtype=np.float64)
    if K.shape == (3, 3):
        K = np.array([K[0, 0], K[1, 1], K[0, 2], K[1, 2]])
    msg = {
        "kind": "depth",
        "depth": encode_array(d),
        "K": [float(x) for x in K.reshape(-1)],
        "T_world_sensor": _pose_wire(T_world_sensor),
    }
    if depth_scale is not None:
        msg["depth_scale"] = float(depth_scale)
    if color is not None:
        msg["color"] = encode_array(np.asarray(color, dtype=np.uint8))
    if timestamp is not None:
        msg["timestamp"] = float(timestamp)
    if frame_id is not None:
        msg["frame_id"] = frame_id
    return msg


def _pose_wire(T) -> dict:
    T = np.asarray(T, dtype=np.float64)
    if T.size != 16:
        raise InvalidArgument(f"T_world_sensor: expected 16 values, got shape {list(T.shape)}")
    return encode_array(T.reshape(4, 4))


def to_jsonable(obj):
    """Arrays -> nested lists (NaN -> None) for JSON responses."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind == "f":
            o = obj.astype(np.float64)
            if not np.isfinite(o).all():
                return np.where(np.isfinite(o), o, None).tolist()
            return o.tolist()
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
