"""POST /v1/maps accepts the ESDF's own voxel (issue 11); it is kept in the map's config and on restart."""

from __future__ import annotations

import numpy as np
from test_service_helpers import client, frame_bytes

from mapper import wire


def test_create_map_with_esdf_voxel_and_restart(tmp_path):
    with client(tmp_path) as c:
        r = c.post("/v1/maps", json={"name": "a", "voxel_size_m": 0.1, "esdf_voxel_size_m": 0.25})
        assert r.status_code == 201, r.text
        mid = r.json()["id"]
        assert r.json()["config"]["esdf_voxel_size_m"] == 0.25
        r = c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(0), headers={"content-type": wire.MSGPACK})
        assert r.status_code == 200, r.text
        box = c.post(f"/v1/maps/{mid}/esdf/box", json={"aabb_min": [0, 0, 0], "aabb_max": [1, 1, 1]})
        assert box.status_code == 200, box.text
        # the default sample spacing is the ESDF voxel: 4 samples per metre
        assert np.isclose(box.json()["resolution_m"], 0.25)
        # finer than the map's voxel, or not a positive number: 4xx naming the argument
        bad = c.post("/v1/maps", json={"name": "b", "voxel_size_m": 0.1, "esdf_voxel_size_m": 0.05})
        assert 400 <= bad.status_code < 500 and "esdf_voxel_size_m" in bad.text
        bad = c.post("/v1/maps", json={"name": "c", "voxel_size_m": 0.1, "esdf_voxel_size_m": -1})
        assert bad.status_code == 422 and "esdf_voxel_size_m" in bad.text
    with client(tmp_path) as c:  # restart: recovered from the WAL with the same config
        m = c.get(f"/v1/maps/{mid}").json()
        assert m["config"]["esdf_voxel_size_m"] == 0.25 and m["frames_integrated"] == 1
