"""The map viewer in a real browser: Playwright drives Debian's Chromium (software WebGL) against a real
``mapper serve`` fed with real frames from ../shared/data. Skips (with the reason) only where Playwright or a
Chromium binary is missing; .ci/run installs Chromium."""

from __future__ import annotations

import io
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from test_service_helpers import READ_TOKEN, TOKEN, Server

from mapper.client import MapperClient
from mapper.datasets import ReplicaSequence

playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (test extra)")

CHROMIUM = next(
    (p for p in (os.environ.get("MAPPER_CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium") if p),
    None,
)
if CHROMIUM is None or not Path(CHROMIUM).exists():
    pytest.skip(
        "no Chromium binary (apt-get install chromium, or set MAPPER_CHROMIUM)", allow_module_level=True
    )

# software WebGL in headless Chromium (no GPU here)
ARGS = ["--use-gl=angle", "--use-angle=swiftshader", "--enable-unsafe-swiftshader", "--no-sandbox"]
BACKGROUND = (0x15, 0x18, 0x1C)  # scene.background in viewer.js
DOCS_SHOT = Path(__file__).resolve().parents[1] / "docs" / "viewer.png"
STRIDE = 8  # Replica frames at 150 x 85 pixels: the test stays small on a 2-core CPU


def replica_frames(root: Path) -> list[dict]:
    """Replica frames 0 and 1, every STRIDE-th pixel (K scaled to match), as the test sends them: frame 0
    with only the left half of the image (a partial first view), then frame 1 whole."""
    seq = ReplicaSequence(root)
    out = []
    for i in (0, 1):
        f = seq[i]
        K = f["K"].copy()
        K[:2, :2] /= STRIDE
        K[:2, 2] = (K[:2, 2] + 0.5) / STRIDE - 0.5
        out.append(
            {
                "depth": np.ascontiguousarray(f["depth_m"][::STRIDE, ::STRIDE]),
                "K": K,
                "T_world_sensor": f["T_world_sensor"],
                "color": np.ascontiguousarray(f["color"][::STRIDE, ::STRIDE]),
            }
        )
    out[0]["depth"][:, out[0]["depth"].shape[1] // 2 :] = 0.0
    return out


def send(c: MapperClient, map_id: str, f: dict) -> dict:
    return c.send_depth(map_id, f["depth"], f["K"], f["T_world_sensor"], color=f["color"])


class Page:
    """A Chromium page on the viewer that records console errors, page errors and failed requests."""

    def __init__(self, browser, url: str):
        self.page = browser.new_page(viewport={"width": 1100, "height": 700})
        self.problems: list[str] = []
        self.requests: list[str] = []
        self.responses: list[tuple[str, int]] = []
        p = self.page
        p.on(
            "console",
            lambda m: self.problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None,
        )
        p.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        p.on("requestfailed", lambda r: self.problems.append(f"request failed: {r.url} {r.failure}"))
        p.on("request", lambda r: self.requests.append(r.url))
        p.on("response", lambda r: self.responses.append((r.url, r.status)))
        self.url = url

    def state(self, key: str):
        return self.page.evaluate(f"window.mapperViewer.state[{key!r}]")

    def wait(self, js: str, timeout_s: float = 60):
        self.page.wait_for_function(js, timeout=timeout_s * 1000, polling=100)

    def canvas_share(self) -> float:
        """Share of the canvas' pixels that differ from the background (a screenshot of the canvas)."""
        from PIL import Image

        png = self.page.locator("#view canvas").screenshot()
        a = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
        return float((np.abs(a - np.array(BACKGROUND)).sum(-1) > 24).mean())


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def test_viewer_live_mesh_slice_and_screenshot(tmp_path, shared_data, browser):
    frames = replica_frames(shared_data / "replica_office0")
    env = {"MAPPER_ESDF_UPDATE": "lazy"}  # acks do not wait for the ESDF; the slice request updates it
    with Server(tmp_path / "data", tmp_path / "server.log", **env) as srv, MapperClient(srv.url) as c:
        m = c.create_map(
            name="office", voxel_size_m=0.1, layers=["tsdf", "color", "esdf"], esdf_max_distance_m=0.5
        )
        send(c, m["id"], frames[0])
        pg = Page(browser, srv.url)
        pg.page.goto(f"{srv.url}/viewer?map={m['id']}")
        pg.page.evaluate("window.__noReload = 1")  # gone if the page reloads
        pg.wait("Number(document.body.dataset.triangles || 0) > 0")
        n1 = pg.state("triangles")
        ref = c.mesh(m["id"])  # the service's own mesh at the same version: same triangle count
        assert pg.state("meshVersion") == ref["version"]
        assert n1 == ref["faces"].shape[0]
        # the defaults: the mesh with axes and a ground grid; the ESDF slice off and not fetched
        pg.wait("Number(document.body.dataset.groundGrid || 0) > 0")
        assert pg.page.is_checked("#show-mesh") and pg.page.is_checked("#show-grid")
        assert not pg.page.is_checked("#show-slice")
        assert pg.state("sliceFetches") == 0 and not any("esdf/slice" in u for u in pg.requests)
        # conditional polling of an idle map: 304s without a body, backed off, no 200 while nothing changes
        pg.wait(
            f"window.mapperViewer.state.meshVersion === {ref['version']}"
            " && window.mapperViewer.state.notModified > 0"
        )
        t0, n0 = time.monotonic(), len(pg.responses)
        pg.page.wait_for_timeout(3000)  # (a time.sleep would hold back Playwright's events)
        idle = [st for u, st in pg.responses[n0:] if "/mesh/blocks" in u]
        assert idle and set(idle) == {304}, idle
        assert len(idle) <= 3.0 / 0.5, (
            f"{len(idle)} mesh polls in {time.monotonic() - t0:.1f} s of an idle map"
        )
        assert pg.state("meshPollMs") == 1000 and pg.state("triangles") == n1
        # the slice on demand: fetched when the box is ticked, unknown cells transparent
        time.sleep(0.3)
        mesh_only = pg.canvas_share()
        assert mesh_only > 0.05, "the WebGL canvas is mostly background"
        pg.page.click("#show-slice")
        pg.wait("document.body.dataset.sliceZ !== undefined && window.mapperViewer.state.sliceHash !== null")
        time.sleep(0.5)
        # unknown slice cells are transparent: the slice at this height, all unknown, hides none of the mesh
        st = pg.state("sliceStats")
        if st["unknown"] == st["w"] * st["h"]:
            assert abs(pg.canvas_share() - mesh_only) < 0.005
        # more frames: the page fetches a delta (since_version) and grows without a reload
        deltas_before = pg.state("deltaFetches")
        send(c, m["id"], frames[1])
        pg.wait(f"window.mapperViewer.state.triangles > {n1}")
        assert pg.page.evaluate("window.__noReload") == 1
        assert pg.state("fullFetches") == 1 and pg.state("deltaFetches") > deltas_before
        assert any("mesh/blocks?since_version=" in u for u in pg.requests)
        assert sum(u.endswith("/mesh/blocks") for u in pg.requests) == 1  # one full mesh, then deltas
        ref = c.mesh(m["id"])
        pg.wait(f"window.mapperViewer.state.meshVersion === {ref['version']}")
        assert pg.state("triangles") == ref["faces"].shape[0]
        # the slice slider: another height gives another slice
        z0, h0, n0 = pg.state("sliceZ"), pg.state("sliceHash"), pg.state("sliceFetches")
        z_new = pg.page.evaluate(
            """() => { const s = document.getElementById('slice-z');
                s.value = Number(s.min) + 0.25 * (Number(s.max) - Number(s.min));
                s.dispatchEvent(new Event('input')); return Number(s.value); }"""
        )
        assert abs(z_new - z0) > 0.05
        pg.wait(
            f"window.mapperViewer.state.sliceFetches > {n0} && window.mapperViewer.state.sliceZ === {z_new}"
        )
        assert pg.state("sliceHash") != h0
        # what the page decoded (msgpack) and coloured = the service's slice at that height
        ref = c.esdf_slice(m["id"], z_new)
        d = np.asarray(ref.distance)
        st = pg.state("sliceStats")
        assert (st["h"], st["w"]) == d.shape and st["origin"] == list(ref.origin_xy)
        assert st["unknown"] == int(np.isnan(d).sum()) and st["inside"] == int((d < 0).sum())
        assert st["unknown"] < d.size  # not all unknown
        assert any(f"z={z_new}" in u for u in pg.requests)
        # the side panel shows the live numbers
        text = pg.page.inner_text("#stats")
        assert "frames integrated" in text and "tsdf voxels" in text and "ack latency" in text
        pg.wait("document.body.dataset.trajectory === '2'")
        assert pg.state("trajectory") == [f["T_world_sensor"][:3, 3].tolist() for f in frames]
        time.sleep(0.3)
        shot = pg.page.screenshot()
        (tmp_path / "viewer.png").write_bytes(shot)
        if os.environ.get("MAPPER_UPDATE_DOCS_SCREENSHOT"):
            DOCS_SHOT.parent.mkdir(exist_ok=True)
            DOCS_SHOT.write_bytes(shot)
        assert pg.problems == [], pg.problems
        pg.page.close()


def test_viewer_bad_inputs_show_messages(tmp_path, shared_data, browser):
    """Unknown map, wrong token, read-only token, an occupancy-only map: a message in the page each time."""
    f0 = replica_frames(shared_data / "replica_office0")[0]
    env = {"MAPPER_API_TOKENS": TOKEN, "MAPPER_READ_TOKENS": READ_TOKEN, "MAPPER_ESDF_UPDATE": "lazy"}
    with Server(tmp_path / "data", tmp_path / "server.log", **env) as srv, MapperClient(srv.url, TOKEN) as c:
        occ = c.create_map(
            name="occ", voxel_size_m=0.1, layers=["occupancy", "esdf"], esdf_max_distance_m=0.5
        )
        send(c, occ["id"], f0)
        pg = Page(browser, srv.url)
        # no token: the page asks for one
        pg.page.goto(f"{srv.url}/viewer?map={occ['id']}")
        pg.wait("!document.getElementById('token-row').hidden")
        assert "needs a token" in pg.page.inner_text("#message")
        # a wrong token: refused, said so
        pg.page.fill("#token", "wrong-token")
        pg.page.click("#token-save")
        pg.wait("/refused/.test(document.getElementById('message').textContent)")
        assert "invalid bearer token" in pg.page.inner_text("#message")
        assert pg.page.is_visible("#overlay")
        # the read-only token: the occupancy-only map shows its voxels, a notice and the slice
        pg.page.fill("#token", READ_TOKEN)
        pg.page.click("#token-save")
        pg.wait("Number(document.body.dataset.voxels || 0) > 0")
        total = c._request("GET", f"/v1/maps/{occ['id']}/occupied").json()["total"]
        assert pg.state("voxels")["shown"] == min(total, 50_000) and pg.state("voxels")["total"] == total
        assert "no TSDF" in pg.page.inner_text("#message")
        pg.wait("window.mapperViewer.state.sliceHash !== null")
        assert pg.canvas_share() > 0.05
        assert pg.page.evaluate("sessionStorage.getItem('mapperToken')") == READ_TOKEN
        # an unknown map id: the service's 404 in the page, not a blank canvas
        pg.page.goto(f"{srv.url}/viewer?map=no-such-map")
        pg.wait("document.body.dataset.overlay === 'shown'")
        assert "not found" in pg.page.inner_text("#message").lower()
        assert pg.page.is_visible("#overlay")
        # the 401s above are the expected answers to the wrong token, nothing else failed
        other = [p for p in pg.problems if "401" not in p and "404" not in p]
        assert other == [], other
        pg.page.close()
