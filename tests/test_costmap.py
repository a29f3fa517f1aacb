"""The 2D cost grid for planners (mapper.formats.costmap): the cost formula on hand-computed cells, the
``nav_msgs/msg/OccupancyGrid`` in the MCAP export and on the live Foxglove server, decoded back with
rosbags' own CDR reader and compared with the map's ESDF slice."""

from __future__ import annotations

import json
import struct
import time

import numpy as np
import pytest
from test_service_helpers import Server, frame_bytes, free_port, scan

from mapper import Map, wire
from mapper.errors import InvalidArgument
from mapper.formats.costmap import cost_from_distance, message_definition, occupancy_grid_cdr

pytest.importorskip("foxglove", reason="foxglove-sdk is not installed")
pytest.importorskip("mcap", reason="mcap is not installed (test extra)")


def ros_decode(data: bytes):
    """Decode with rosbags directly (not through mapper.formats.costmap)."""
    from rosbags.typesys import Stores, get_typestore

    return get_typestore(Stores.ROS2_HUMBLE).deserialize_cdr(data, "nav_msgs/msg/OccupancyGrid")


def expected_cost(d: np.ndarray, lethal=0.2, inflation=1.0) -> np.ndarray:
    out = np.empty(d.shape, np.int8)
    for idx, v in np.ndenumerate(d):
        if np.isnan(v):
            out[idx] = -1
        elif v <= lethal:
            out[idx] = 100
        elif v >= inflation:
            out[idx] = 0
        else:
            out[idx] = int(np.rint(100 * (inflation - v) / (inflation - lethal)))
    return out


def test_cost_from_distance_hand_computed():
    d = np.array([[np.nan, -0.3, 0.0, 0.2], [0.6, 1.0, 5.0, 0.4]])
    np.testing.assert_array_equal(cost_from_distance(d), [[-1, 100, 100, 100], [50, 0, 0, 75]])
    rng = np.random.default_rng(0)
    d = rng.uniform(-0.5, 2.0, (30, 40))
    d[rng.random(d.shape) < 0.2] = np.nan
    np.testing.assert_array_equal(cost_from_distance(d, 0.1, 0.7), expected_cost(d, 0.1, 0.7))
    assert cost_from_distance(d).dtype == np.int8
    with pytest.raises(InvalidArgument, match="lethal_m < inflation_m"):
        cost_from_distance(d, 1.0, 0.5)
    with pytest.raises(InvalidArgument, match=r"\[H, W\]"):
        cost_from_distance(np.zeros(5))


def test_occupancy_grid_message_fields():
    cost = np.array([[-1, 0, 50], [100, 7, 0]], np.int8)
    msg = ros_decode(occupancy_grid_cdr(cost, (-1.5, 2.0), 0.1, 0.75, t_s=12.25))
    assert (msg.info.width, msg.info.height) == (3, 2) and msg.info.resolution == pytest.approx(0.1)
    assert (msg.info.origin.position.x, msg.info.origin.position.y, msg.info.origin.position.z) == (
        -1.5,
        2.0,
        0.75,
    )
    assert msg.info.origin.orientation.w == 1.0 and msg.header.frame_id == "world"
    assert (msg.header.stamp.sec, msg.header.stamp.nanosec) == (12, 250_000_000)
    np.testing.assert_array_equal(msg.data.reshape(2, 3), cost)  # row-major, row 0 = lowest y
    assert message_definition().startswith("std_msgs/Header header")


def test_costmap_in_the_mcap_export(tmp_path):
    from mcap.reader import make_reader

    from mapper.foxglove import export_map

    m = Map(0.25, layers=("tsdf", "esdf"), device="cpu", esdf_max_distance_m=1.0)
    for i in range(3):
        m.integrate_lidar(*scan(i))
    path = export_map(m, "lab", tmp_path / "lab.mcap", z_m=0.5)
    with open(path, "rb") as f:
        found = [(s, c, x) for s, c, x in make_reader(f).iter_messages() if c.topic == "/maps/lab/costmap"]
    ((schema, channel, message),) = found
    assert schema.name == "nav_msgs/msg/OccupancyGrid" and schema.encoding == "ros2msg"
    assert channel.message_encoding == "cdr"
    grid = ros_decode(message.data)
    s = m.esdf_slice(0.5)
    d = s.distance.numpy()
    assert (grid.info.height, grid.info.width) == d.shape and grid.info.resolution == 0.25
    assert (grid.info.origin.position.x, grid.info.origin.position.y) == tuple(s.origin_xy)
    got = grid.data.reshape(d.shape)
    np.testing.assert_array_equal(got, expected_cost(d))
    assert (got == -1).any() and (got == 100).any() and ((got > 0) & (got < 100)).any()


def test_costmap_on_the_live_foxglove_server(tmp_path):
    import httpx
    from websockets.sync.client import connect

    port = free_port()
    with Server(tmp_path / "data", tmp_path / "server.log", MAPPER_FOXGLOVE_PORT=port) as srv:
        http = httpx.Client(base_url=srv.url, timeout=300)
        body = {"name": "cm", "voxel_size_m": 0.25, "esdf_max_distance_m": 1.0}
        mid = http.post("/v1/maps", json=body).json()["id"]
        r = http.post(
            f"/v1/maps/{mid}/frames", content=frame_bytes(0), headers={"content-type": wire.MSGPACK}
        )
        assert r.status_code == 200
        with connect(f"ws://127.0.0.1:{port}", subprotocols=["foxglove.sdk.v1"], open_timeout=30) as ws:
            channels, deadline = {}, time.monotonic() + 30
            while "/maps/cm/costmap" not in channels:
                assert time.monotonic() < deadline, f"not advertised: {sorted(channels)}"
                msg = ws.recv(timeout=30)
                if isinstance(msg, str) and json.loads(msg)["op"] == "advertise":
                    channels |= {ch["topic"]: ch for ch in json.loads(msg)["channels"]}
            ch = channels["/maps/cm/costmap"]
            assert ch["encoding"] == "cdr" and ch["schemaName"] == "nav_msgs/msg/OccupancyGrid"
            assert ch["schemaEncoding"] == "ros2msg"
            ws.send(json.dumps({"op": "subscribe", "subscriptions": [{"id": 7, "channelId": ch["id"]}]}))
            deadline = time.monotonic() + 60
            while True:
                assert time.monotonic() < deadline, "no costmap arrived"
                msg = ws.recv(timeout=60)
                if isinstance(msg, bytes) and msg[0] == 0x01 and struct.unpack_from("<I", msg, 1)[0] == 7:
                    grid = ros_decode(msg[13:])
                    break
        z = grid.info.origin.position.z
        sl = httpx.get(f"{srv.url}/v1/maps/{mid}/esdf/slice", params={"z": z, "format": "msgpack"},
                       headers={"accept": wire.MSGPACK}, timeout=60)  # fmt: skip
        s = wire.unpackb(sl.content)
        d = wire.decode_array(s["distance"], "distance")
    assert z == pytest.approx(scan(0)[1][2, 3])  # the slice at the sensor's height
    assert (grid.info.height, grid.info.width) == d.shape
    np.testing.assert_array_equal(grid.data.reshape(d.shape), expected_cost(d))
