"""The wire format: arrays, frames, validation messages (no server)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from mapper import InvalidArgument, InvalidArgumentType, wire


def lidar(n=10, dtype=np.float32):
    return np.random.default_rng(0).normal(size=(n, 3)).astype(dtype) * 5


@pytest.mark.parametrize("dtype", ["float32", "float64", "uint16", "uint8", "int32"])
def test_array_round_trip(dtype):
    a = (np.arange(24) % 200).astype(dtype).reshape(2, 3, 4)
    enc = wire.encode_array(a)
    assert enc["dtype"] == dtype and enc["shape"] == [2, 3, 4]
    b = wire.decode_array(msgpack.unpackb(wire.packb(enc)), "a")
    assert b.dtype == a.dtype and np.array_equal(a, b) and b.flags.writeable


def test_output_dtypes_map_to_wire_dtypes():
    assert wire.encode_array(np.array([True, False]))["dtype"] == "uint8"
    assert wire.encode_array(np.array([-1, 0, 1], dtype=np.int8))["dtype"] == "int32"
    assert wire.encode_array(np.array([1], dtype=np.int64))["dtype"] == "int32"
    assert wire.encode_array(np.array([1], dtype=np.float16))["dtype"] == "float32"
    with pytest.raises(InvalidArgument, match="int32"):
        wire.encode_array(np.array([2**40]))


def test_decode_array_errors():
    good = wire.encode_array(np.zeros((2, 3), np.float32))
    with pytest.raises(InvalidArgumentType, match="dtype"):
        wire.decode_array({**good, "dtype": "complex64"}, "points")
    with pytest.raises(InvalidArgument, match="needs 24"):
        wire.decode_array({**good, "data": good["data"][:-1]}, "points")
    with pytest.raises(InvalidArgument, match="shape"):
        wire.decode_array({**good, "shape": [-1, 3]}, "points")
    with pytest.raises(InvalidArgument, match="binary"):
        wire.decode_array({**good, "data": "text"}, "points")
    with pytest.raises(wire.TooLarge):
        wire.decode_array(good, "points", max_elements=5)
    with pytest.raises(InvalidArgumentType, match="numbers"):
        wire.decode_array([["a", "b"]], "points")


def test_lidar_frame_round_trip():
    pts = lidar(100)
    T = np.eye(4)
    T[:3, 3] = [1, 2, 3]
    msg = msgpack.unpackb(wire.packb(wire.lidar_message(pts, T, 1.5, "f1")))
    f = wire.parse_frame(msg)
    assert isinstance(f, wire.LidarFrame) and f.frame_id == "f1" and f.timestamp == 1.5
    assert np.array_equal(f.points, pts) and np.allclose(f.T_world_sensor, T)
    again = wire.parse_frame(msgpack.unpackb(wire.packb(wire.frame_to_wire(f))))
    assert np.array_equal(again.points, pts)


def test_json_style_frame_and_pose_as_16_numbers():
    f = wire.parse_frame(
        {"kind": "lidar", "points": [[1, 2, 3], [4, 5, 6]], "T_world_sensor": list(np.eye(4).ravel())}
    )
    assert f.points.shape == (2, 3) and f.T_world_sensor.shape == (4, 4)


def test_depth_frame_uint16_with_scale():
    d = np.full((4, 5), 1000, np.uint16)
    msg = msgpack.unpackb(wire.packb(wire.depth_message(d, [500, 500, 2, 2], np.eye(4), depth_scale=1000.0)))
    f = wire.parse_frame(msg)
    assert f.depth_m.dtype == np.float32 and np.allclose(f.depth_m, 1.0)
    del msg["depth_scale"]
    with pytest.raises(InvalidArgument, match="depth_scale"):
        wire.parse_frame(msg)


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda m: m.update(kind="radar"), InvalidArgument, "kind"),
        (
            lambda m: m.update(points=wire.encode_array(np.zeros((0, 3), np.float32))),
            InvalidArgument,
            "empty",
        ),
        (
            lambda m: m.update(points=wire.encode_array(np.zeros((5, 2), np.float32))),
            InvalidArgument,
            r"\[N, 3\]",
        ),
        (
            lambda m: m.update(points=wire.encode_array(np.zeros((5, 3), np.int32))),
            InvalidArgumentType,
            "dtype",
        ),
        (
            lambda m: m.update(points=wire.encode_array(np.full((5, 3), np.inf, np.float32))),
            InvalidArgument,
            "Inf",
        ),
        (
            lambda m: m.update(points=wire.encode_array(np.full((5, 3), np.nan, np.float32))),
            InvalidArgument,
            "finite",
        ),
        (lambda m: m.update(T_world_sensor=[1.0] * 16), InvalidArgument, "rotation"),
        (lambda m: m.update(T_world_sensor=[1.0] * 15), InvalidArgument, "4, 4"),
        (lambda m: m.update(timestamp="now"), InvalidArgumentType, "timestamp"),
        (lambda m: m.update(frame_id=7), InvalidArgumentType, "frame_id"),
    ],
)
def test_bad_frames_name_the_field(mutate, exc, match):
    msg = wire.lidar_message(lidar(), np.eye(4), 0.0)
    mutate(msg)
    with pytest.raises(exc, match=match):
        wire.parse_frame(msg)


def test_lidar_frame_without_pose():
    """No pose (absent or null): the map registers the scan; a client cannot claim an estimated pose."""
    msg = wire.lidar_message(lidar(), None, 0.0)
    assert "T_world_sensor" not in msg
    f = wire.parse_frame(msg)
    assert f.T_world_sensor is None and not f.pose_estimated
    assert wire.parse_frame({**msg, "T_world_sensor": None, "pose_estimated": True}).pose_estimated is False
    assert "T_world_sensor" not in wire.frame_to_wire(f)
    depth = wire.depth_message(np.ones((4, 4)), [1, 1, 1, 1], np.eye(4))
    depth.pop("T_world_sensor")
    with pytest.raises(InvalidArgument, match="T_world_sensor: required"):
        wire.parse_frame(depth)


def test_nan_rows_are_no_returns():
    pts = lidar(10)
    pts[:3] = np.nan
    f = wire.parse_frame(wire.lidar_message(pts, np.eye(4)))
    assert f.points.shape == (10, 3)


def _points_oracle(xyz: np.ndarray) -> str | None:
    """What the frame checks say about points ``[N, 3]`` (element by element, no library code): the error's
    keyword, or None when they are accepted."""
    if any(v in (np.inf, -np.inf) for v in xyz.reshape(-1).tolist()):
        return "Inf"
    if not any(all(np.isfinite(v) for v in row) for row in xyz.tolist()):
        return "finite"
    return None


@pytest.mark.parametrize(
    "case",
    ["plain", "huge", "huge64", "one_inf", "minus_inf_and_nan", "nan_rows", "all_nan", "inf_intensity"],
)
def test_points_checks_against_an_oracle(case):
    """The one-pass check (a sum of the coordinates is finite) and the per-value checks it falls back to
    agree with an element-wise oracle, including coordinates whose float32 sum overflows to Inf."""
    rng = np.random.default_rng(3)
    pts = rng.normal(size=(50, 4)).astype(np.float32) * 5
    if case == "huge":
        pts[:, :3] = 3e38  # finite, but their float32 sum is Inf: accepted
    elif case == "huge64":
        pts = pts.astype(np.float64)
        pts[:, :3] = 1.7e308
    elif case == "one_inf":
        pts[17, 1] = np.inf
    elif case == "minus_inf_and_nan":
        pts[3, 0], pts[4, 2] = np.nan, -np.inf
    elif case == "nan_rows":
        pts[::2, 1] = np.nan  # rows with a NaN are no returns; the others are finite
    elif case == "all_nan":
        pts[:, 2] = np.nan
    elif case == "inf_intensity":
        pts[:, 3] = np.inf  # only x, y, z are checked
    want = _points_oracle(pts[:, :3])
    msg = wire.lidar_message(pts, np.eye(4))
    if want is None:
        f = wire.parse_frame(msg)
        np.testing.assert_array_equal(f.points, pts)
    else:
        with pytest.raises(InvalidArgument, match=want):
            wire.parse_frame(msg)


def test_limits():
    lim = wire.Limits(max_points=5, max_pixels=10)
    with pytest.raises(wire.TooLarge, match="limit"):
        wire.parse_frame(wire.lidar_message(lidar(6), np.eye(4)), lim)
    with pytest.raises(wire.TooLarge, match="limit"):
        wire.parse_frame(wire.depth_message(np.ones((4, 4)), [1, 1, 1, 1], np.eye(4)), lim)


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x92\x01", wire.packb({"a": 1})[:-1], b"\x81\x01\x02"])
def test_malformed_msgpack(data):
    with pytest.raises(wire.MalformedMessage):
        wire.unpackb(data)
