"""Once tokens are set: `/readyz` without a token says only whether the service is ready (no map ids, no
error text), with a read token it gives the details; `/openapi.json`, `/docs` and `/redoc` need a read
token (the bearer header, or `?token=` for a browser, which the pages pass on to the spec they load)."""

from __future__ import annotations

import json

from test_service_helpers import READ_TOKEN, TOKEN, client

READ = {"authorization": f"Bearer {READ_TOKEN}"}


def test_readyz_details_need_a_token(tmp_path):
    with client(tmp_path, api_tokens=TOKEN, read_tokens=READ_TOKEN) as c:
        auth = {"authorization": f"Bearer {TOKEN}"}
        body = {"name": "bad", "voxel_size_m": 0.25, "layers": ["tsdf"]}
        mid = c.post("/v1/maps", json=body, headers=auth).json()["id"]
    path = tmp_path / "data" / "maps" / mid / "info.json"  # invalid on the next start: listed as failed
    info = json.loads(path.read_text())
    info["name"] = 12345
    path.write_text(json.dumps(info))
    with client(tmp_path, api_tokens=TOKEN, read_tokens=READ_TOKEN) as c:
        r = c.get("/readyz")
        assert r.status_code == 200 and r.json() == {"status": "ready"}
        assert mid not in r.text
        for headers in (READ, {"authorization": f"Bearer {TOKEN}"}):
            full = c.get("/readyz", headers=headers).json()
            assert full["status"] == "ready" and "expected a string" in full["failed"][mid]
            assert "quarantined" in full and "device" in full
        bad = c.get("/readyz", headers={"authorization": "Bearer nope"})
        assert bad.status_code == 401 and mid not in bad.text
    with client(tmp_path) as c:  # no tokens configured (loopback only): the details as before
        assert mid in c.get("/readyz").json()["failed"]


def test_openapi_and_docs_need_a_token(tmp_path):
    with client(tmp_path, api_tokens=TOKEN, read_tokens=READ_TOKEN) as c:
        for page in ("/openapi.json", "/docs", "/redoc"):
            r = c.get(page)
            assert r.status_code == 401 and r.json()["type"] == "unauthorized", page
            assert "/v1/maps" not in r.text
            assert c.get(page, params={"token": "wrong"}).status_code == 401
            assert c.get(page, headers=READ).status_code == 200, page
            r = c.get(page, params={"token": READ_TOKEN})
            assert r.status_code == 200, page
        spec = c.get("/openapi.json", headers=READ).json()
        assert "/v1/maps" in spec["paths"]
        # a page opened with ?token= loads the spec with it
        html = c.get("/docs", params={"token": READ_TOKEN}).text
        assert f"/openapi.json?token={READ_TOKEN}" in html
        assert f"/openapi.json?token={READ_TOKEN}" in c.get("/redoc", params={"token": READ_TOKEN}).text
        # the packaged scripts stay public (no map data in them)
        assert c.get("/docs-static/swagger-ui-bundle.js").status_code == 200
    with client(tmp_path) as c:  # no tokens: open (loopback only)
        assert c.get("/openapi.json").status_code == 200
