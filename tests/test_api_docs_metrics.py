"""Offline API docs (/docs, /redoc load nothing from the internet) and the metrics a fleet dashboard needs:
map names beside ids, build info, last-frame time, ICP fitness of frames without a pose."""

from __future__ import annotations

import re
import time

from prometheus_client.parser import text_string_to_metric_families
from test_api import new_map, post_frame
from test_service_helpers import TOKEN, client, scan

from mapper import wire


def _samples(text: str) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_docs_pages_use_only_packaged_assets(tmp_path):
    with client(tmp_path, api_tokens=[TOKEN]) as c:  # auth on: the pages need a token (?token= in a browser)
        for page, assets in (("/docs", 2), ("/redoc", 1)):
            r = c.get(page, params={"token": TOKEN})
            assert r.status_code == 200 and "text/html" in r.headers["content-type"]
            srcs = re.findall(r'(?:src|href)="([^"]+)"', r.text)
            remote = [u for u in srcs if u.startswith(("http:", "https:", "//"))]
            assert not remote, f"{page} loads {remote}"
            local = [u for u in srcs if u.endswith((".js", ".css"))]
            assert len(local) == assets
            for u in local:
                a = c.get(u)
                assert a.status_code == 200 and len(a.content) > 10_000, u  # the real bundle, not a stub
            assert "/openapi.json" in r.text
        assert c.get("/openapi.json", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_metrics_names_build_info_last_frame_and_icp(tmp_path):
    with client(tmp_path) as c:
        mid = new_map(c, name="lab", voxel=0.25, layers=("tsdf",))
        t0 = time.time()
        post_frame(c, mid, 0)  # posed
        pts, _ = scan(1)
        r = c.post(  # no pose: registered against the map
            f"/v1/maps/{mid}/frames",
            content=wire.packb(wire.lidar_message(pts, None, 1.0)),
            headers={"content-type": wire.MSGPACK, "accept": "application/json"},
        )
        assert r.status_code == 200, r.text
        reg = r.json()["registration"]
        s = _samples(c.get("/metrics").text)
        assert s[("mapper_frames_total", (("kind", "lidar"), ("map", mid), ("name", "lab")))] == 2.0
        last = s[("mapper_last_frame_timestamp_seconds", (("map", mid), ("name", "lab")))]
        assert t0 - 1 <= last <= time.time() + 1
        assert s[("mapper_registration_fitness", (("map", mid), ("name", "lab")))] == reg["fitness"]
        assert s[("mapper_registration_rmse_meters", (("map", mid), ("name", "lab")))] == reg["rmse_m"]
        assert 0.5 < reg["fitness"] <= 1.0  # the same room seen 10 cm further on
        assert s[("mapper_registration_fitness_ratio_count", ())] == 1.0
        build = [k for k in s if k[0] == "mapper_build_info"]
        assert len(build) == 1 and dict(build[0][1])["version"] == __import__("mapper").__version__
        assert c.delete(f"/v1/maps/{mid}").status_code in (200, 204)
        left = [k for k in _samples(c.get("/metrics").text) if ("map", mid) in k[1]]
        assert left == [], left  # a deleted map's series are gone
