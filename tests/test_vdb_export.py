"""OpenVDB / NanoVDB export of the TSDF and ESDF, read back by readers that are not mapper's:

* ``.vdb``: Debian's ``python3-openvdb`` (OpenVDB 10) in the system Python, in a subprocess: every active
  voxel's coordinate and value, the background and the transform, compared with the map's observed voxels;
* ``.nvdb``: a parser written here from NanoVDB's documented layout (``NanoVDB.h`` / ``util/IO.h``: header,
  metadata, GridData, TreeData, root tiles, upper / lower / leaf nodes, byte offsets) walking the tree
  from the root, and, where installed (``libnanovdb-tools``), ``nanovdb_validate`` and ``nanovdb_convert``
  back to ``.vdb`` for OpenVDB to read.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_service_helpers import client, frame_bytes, scan

from mapper import Map, wire
from mapper.errors import InvalidArgument
from mapper.formats.nanovdb import nvdb_bytes
from mapper.formats.vdb import VoxelGrid, map_layer_grid, vdb_bytes

SYSTEM_PYTHON = "/usr/bin/python3"

READ_VDB = r"""
import json, sys
import pyopenvdb as vdb
out = {}
for g in vdb.readAll(sys.argv[1])[0]:
    vox = [(list(it.min), it.value) for it in g.citerOnValues() if it.count == 1]
    out[g.name] = {
        "ijk": [v[0] for v in vox], "values": [v[1] for v in vox], "background": g.background,
        "voxel_size": list(g.transform.voxelSize()), "origin": list(g.transform.indexToWorld((0, 0, 0))),
        "class": g.gridClass, "type": g.valueTypeName, "active": g.activeVoxelCount(),
    }
print(json.dumps(out))
"""


def have_openvdb() -> bool:
    if not Path(SYSTEM_PYTHON).exists():
        return False
    return subprocess.run([SYSTEM_PYTHON, "-c", "import pyopenvdb"], capture_output=True).returncode == 0


needs_openvdb = pytest.mark.skipif(
    not have_openvdb(), reason="python3-openvdb is not installed (apt-get install python3-openvdb)"
)


def read_vdb(path: Path) -> dict:
    r = subprocess.run(
        [SYSTEM_PYTHON, "-c", READ_VDB, str(path)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def sorted_voxels(ijk, values) -> tuple[np.ndarray, np.ndarray]:
    ijk, values = np.asarray(ijk, np.int64).reshape(-1, 3), np.asarray(values, np.float32)
    o = np.lexsort(ijk.T[::-1])
    return ijk[o], values[o]


@pytest.fixture(scope="module")
def lidar_map() -> Map:
    m = Map(0.25, layers=("tsdf", "esdf"), esdf_max_distance_m=1.0, device="cpu")
    for i in range(2):
        m.integrate_lidar(*scan(i))
    m.update_esdf()
    return m


def oracle(m: Map, layer: str):
    """The observed voxels straight from the map's layer view (not through mapper.formats.vdb)."""
    g, d = m.layer(layer)
    ijk = g.ijk.numpy()
    if layer == "tsdf":
        keep = d["weight"].numpy() > 0
        return sorted_voxels(ijk[keep], d["tsdf"].numpy()[keep])
    keep = d["observed"].numpy().astype(bool)
    return sorted_voxels(ijk[keep], d["esdf"].numpy()[keep])


# --------------------------------------------------------------------------------------- OpenVDB
@needs_openvdb
@pytest.mark.parametrize("compress", [True, False])
def test_vdb_read_by_openvdb_equals_the_map(tmp_path, lidar_map, compress):
    grids = [map_layer_grid(lidar_map, "tsdf"), map_layer_grid(lidar_map, "esdf")]
    path = tmp_path / "map.vdb"
    path.write_bytes(vdb_bytes(grids, compress=compress))
    got = read_vdb(path)
    assert set(got) == {"tsdf", "esdf"}
    for layer, voxel, bg in (("tsdf", 0.25, 0.75), ("esdf", lidar_map.esdf_voxel_size_m, 1.0)):
        ref_ijk, ref_v = oracle(lidar_map, layer)
        assert ref_ijk.shape[0] > 1000  # a real map, not a toy
        g = got[layer]
        ijk, v = sorted_voxels(g["ijk"], g["values"])
        assert g["active"] == ref_ijk.shape[0] and g["type"] == "float"
        np.testing.assert_array_equal(ijk, ref_ijk)
        np.testing.assert_array_equal(v, ref_v)  # float32 both ways: exact
        assert g["background"] == pytest.approx(bg)
        assert g["voxel_size"] == pytest.approx([voxel] * 3)
        assert g["origin"] == pytest.approx([voxel / 2] * 3)  # voxel (0,0,0) is centred at half a voxel
    assert got["tsdf"]["class"] == "level set"


@needs_openvdb
def test_vdb_negative_and_far_coordinates(tmp_path):
    """Voxels in several upper nodes, on both sides of zero, in one leaf and alone."""
    rng = np.random.default_rng(3)
    ijk = np.unique(
        np.concatenate([rng.integers(-300, 300, (3000, 3)), [[5000, -7000, 3], [-1, -1, -1]]]), axis=0
    )
    vals = rng.normal(size=ijk.shape[0]).astype(np.float32)
    path = tmp_path / "t.vdb"
    path.write_bytes(vdb_bytes([VoxelGrid.from_arrays("g", ijk, vals, 9.0, 0.1)]))
    g = read_vdb(path)["g"]
    a, b = sorted_voxels(g["ijk"], g["values"])
    ra, rb = sorted_voxels(ijk, vals)
    np.testing.assert_array_equal(a, ra)
    np.testing.assert_array_equal(b, rb)


def test_grid_input_errors():
    ok = np.zeros((2, 3), np.int64)
    ok[1] = 1
    with pytest.raises(InvalidArgument, match="ijk"):
        VoxelGrid.from_arrays("g", np.zeros((2, 2)), np.zeros(2), 0, 0.1)
    with pytest.raises(InvalidArgument, match="values: expected shape"):
        VoxelGrid.from_arrays("g", ok, np.zeros(3), 0, 0.1)
    with pytest.raises(InvalidArgument, match="finite"):
        VoxelGrid.from_arrays("g", ok, [0.0, np.nan], 0, 0.1)
    with pytest.raises(InvalidArgument, match="voxel_size_m"):
        VoxelGrid.from_arrays("g", ok, [0.0, 1.0], 0, -1)
    with pytest.raises(InvalidArgument, match="beyond"):
        VoxelGrid.from_arrays("g", [[2**31 - 1, 0, 0]], [0.0], 0, 0.1)
    with pytest.raises(InvalidArgument, match="not unique"):
        vdb_bytes([VoxelGrid.from_arrays("g", [[1, 2, 3], [1, 2, 3]], [0.0, 1.0], 0, 0.1)])
    with pytest.raises(InvalidArgument, match="shorter than 256"):
        nvdb_bytes([VoxelGrid.from_arrays("x" * 300, ok, [0.0, 1.0], 0, 0.1)])
    with pytest.raises(InvalidArgument, match="no 'esdf' layer"):
        map_layer_grid(Map(0.25, layers=("tsdf",), device="cpu"), "esdf")


# --------------------------------------------------------------------------------------- NanoVDB
def parse_nvdb(data: bytes) -> dict[str, dict]:
    """An independent reader of NanoVDB 32.x files (float grids, codec NONE), from the documented layout."""
    out, pos = {}, 0
    while pos < len(data):
        magic, version, count, codec = struct.unpack_from("<QIHH", data, pos)
        assert magic == 0x304244566F6E614E and codec == 0 and version >> 21 == 32
        pos += 16
        metas = []
        for _ in range(count):
            grid_size, file_size, key, voxels, gtype, gclass = struct.unpack_from("<QQQQII", data, pos)
            wbb = struct.unpack_from("<6d", data, pos + 40)
            ibb = struct.unpack_from("<6i", data, pos + 88)
            vs = struct.unpack_from("<3d", data, pos + 112)
            (name_size,) = struct.unpack_from("<I", data, pos + 136)
            nodes = struct.unpack_from("<4I", data, pos + 140)
            tiles = struct.unpack_from("<3I", data, pos + 156)
            name = data[pos + 176 : pos + 176 + name_size - 1].decode()
            assert data[pos + 176 + name_size - 1] == 0
            m = dict(grid_size=grid_size, file_size=file_size, key=key, voxels=voxels, type=gtype, cls=gclass)
            metas.append(dict(m, wbb=wbb, ibb=ibb, vs=vs, name=name, nodes=nodes, tiles=tiles))
            pos += 176 + name_size
        for m in metas:
            g = data[pos : pos + m["grid_size"]]
            pos += m["file_size"]
            out[m["name"]] = {"meta": m, **parse_grid(g)}
    return out


def parse_grid(g: bytes) -> dict:
    magic, checksum, version, flags, index, count, size = struct.unpack_from("<QQIIIIQ", g, 0)
    assert magic == 0x304244566F6E614E and size == len(g) and (index, count) == (0, 1)
    name = g[40:296].split(b"\0")[0].decode()
    mat = np.array(struct.unpack_from("<9d", g, 296 + 88)).reshape(3, 3)
    vec = np.array(struct.unpack_from("<3d", g, 296 + 88 + 144))
    wbb = struct.unpack_from("<6d", g, 560)
    voxel = struct.unpack_from("<3d", g, 608)
    gclass, gtype = struct.unpack_from("<II", g, 632)
    offs = struct.unpack_from("<4Q", g, 672)
    n_leaf, n_lower, n_upper = struct.unpack_from("<3I", g, 704)
    tiles = struct.unpack_from("<3I", g, 716)
    (voxel_count,) = struct.unpack_from("<Q", g, 728)
    root = 672 + offs[3]
    rbb = struct.unpack_from("<6i", g, root)
    table_size, background, rmin, rmax = struct.unpack_from("<I3f", g, root + 24)
    ijk, vals, seen = [], [], {"upper": [], "lower": [], "leaf": []}

    def internal(at, dim, child_dim_total, level):
        n = 1 << (3 * dim)
        value_mask = np.unpackbits(np.frombuffer(g, np.uint8, n // 8, at + 32), bitorder="little")
        child_mask = np.unpackbits(np.frombuffer(g, np.uint8, n // 8, at + 32 + n // 8), bitorder="little")
        assert not value_mask.any()  # no active tiles
        table_at = at + ((32 + 2 * (n // 8) + 16 + 31) // 32) * 32
        table = np.frombuffer(g, "<i8", n, table_at)
        tile_values = np.frombuffer(g, "<f4", 2 * n, table_at)[0::2]
        assert (tile_values[child_mask == 0] == background).all()
        seen[level].append(at)
        for c in np.flatnonzero(child_mask):
            child = at + int(table[c])
            if dim == 5:
                internal(child, 4, 3, "lower")
            else:
                leaf(child)

    def leaf(at):
        seen["leaf"].append(at)
        bmin = np.array(struct.unpack_from("<3i", g, at))
        origin = bmin & ~7
        mask = np.unpackbits(np.frombuffer(g, np.uint8, 64, at + 16), bitorder="little").astype(bool)
        values = np.frombuffer(g, "<f4", 512, at + 96)
        assert (values[~mask] == background).all()
        n = np.flatnonzero(mask)
        ijk.append(origin + np.stack((n >> 6, (n >> 3) & 7, n & 7), 1))
        vals.append(values[mask])

    for t in range(table_size):
        key, child, state, value = struct.unpack_from("<QqIf", g, root + 64 + 32 * t)
        assert child != 0 and state == 0
        upper = root + child
        # the key is the upper node's origin (21 bits per axis) and the node's bbox lies inside it
        bb = np.array(struct.unpack_from("<6i", g, upper)).reshape(2, 3)
        assert (
            (bb[0].astype(np.int64) & 0xFFFFFFFF) >> 12
            == [(key >> 42) & 0x1FFFFF, (key >> 21) & 0x1FFFFF, key & 0x1FFFFF]
        ).all()
        internal(upper, 5, 7, "upper")
    ijk = np.concatenate(ijk) if ijk else np.zeros((0, 3), np.int64)
    vals = np.concatenate(vals) if vals else np.zeros(0, np.float32)
    return dict(
        name=name, checksum=checksum, version=version, flags=flags, mat=mat, vec=vec, wbb=wbb, voxel=voxel,
        cls=gclass, type=gtype, offsets=offs, counts=(n_leaf, n_lower, n_upper), tiles=tiles,
        voxel_count=voxel_count, root_bbox=rbb, background=background, min=rmin, max=rmax,
        table_size=table_size, ijk=ijk, values=vals, seen=seen, root=root,
    )  # fmt: skip


def test_nvdb_layout_and_values_equal_the_map(tmp_path, lidar_map):
    grids = [map_layer_grid(lidar_map, "tsdf"), map_layer_grid(lidar_map, "esdf")]
    data = nvdb_bytes(grids)
    parsed = parse_nvdb(data)
    assert list(parsed) == ["tsdf", "esdf"]
    for layer, voxel in (("tsdf", 0.25), ("esdf", lidar_map.esdf_voxel_size_m)):
        ref_ijk, ref_v = oracle(lidar_map, layer)
        p = parsed[layer]
        m = p["meta"]
        ijk, v = sorted_voxels(p["ijk"], p["values"])
        np.testing.assert_array_equal(ijk, ref_ijk)
        np.testing.assert_array_equal(v, ref_v)
        # counts: brute force from the voxels
        n_leaf = np.unique(ref_ijk >> 3, axis=0).shape[0]
        n_lower = np.unique(ref_ijk >> 7, axis=0).shape[0]
        n_upper = np.unique(ref_ijk >> 12, axis=0).shape[0]
        assert p["counts"] == (n_leaf, n_lower, n_upper) and p["table_size"] == n_upper
        assert m["nodes"] == (n_leaf, n_lower, n_upper, 1) and m["tiles"] == (0, 0, 0) == p["tiles"]
        assert p["voxel_count"] == m["voxels"] == ref_ijk.shape[0]
        # node offsets: tree at 672, root right after it (64), then the upper, lower and leaf arrays
        # (270400, 33856, 2144 bytes a node), visited in that order by the walk above
        assert p["offsets"][3] == 64 and p["root"] == 736
        up0 = 736 + 64 + 32 * n_upper
        assert p["offsets"][2] + 672 == up0 == min(p["seen"]["upper"])
        assert p["offsets"][1] + 672 == up0 + 270400 * n_upper == min(p["seen"]["lower"])
        assert p["offsets"][0] + 672 == up0 + 270400 * n_upper + 33856 * n_lower == min(p["seen"]["leaf"])
        assert m["grid_size"] == m["file_size"] == p["offsets"][0] + 672 + 2144 * n_leaf
        assert all(a % 32 == 0 for lv in p["seen"].values() for a in lv)
        # header fields
        assert p["name"] == layer and p["type"] == 1 == m["type"] and p["cls"] == m["cls"]
        assert p["cls"] == (1 if layer == "tsdf" else 0)
        assert p["version"] >> 21 == 32 and p["checksum"] == 2**64 - 1  # checksum disabled
        np.testing.assert_allclose(p["mat"], np.eye(3) * voxel)
        np.testing.assert_allclose(p["vec"], [voxel / 2] * 3)
        assert p["voxel"] == pytest.approx((voxel,) * 3) == m["vs"]
        assert list(p["root_bbox"]) == [*ref_ijk.min(0), *ref_ijk.max(0)] == list(m["ibb"])
        assert p["min"] == ref_v.min() and p["max"] == ref_v.max()
        np.testing.assert_allclose(p["wbb"][:3], (ref_ijk.min(0) + 0.5) * voxel)
        np.testing.assert_allclose(p["wbb"][3:], (ref_ijk.max(0) + 1.5) * voxel)
        h = 0
        for c in layer.encode():
            h = (h * 67 + c + (h >> 56)) & (2**64 - 1)
        assert m["key"] == h


@pytest.mark.skipif(
    not shutil.which("nanovdb_validate"), reason="NanoVDB tools not installed (libnanovdb-tools)"
)
def test_nvdb_passes_nanovdbs_own_validator_and_converts_back(tmp_path, lidar_map):
    grids = [map_layer_grid(lidar_map, "tsdf"), map_layer_grid(lidar_map, "esdf")]
    path = tmp_path / "map.nvdb"
    path.write_bytes(nvdb_bytes(grids))
    r = subprocess.run(["nanovdb_validate", "-v", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.count("passed") == 2, r.stdout + r.stderr
    if not have_openvdb() or not shutil.which("nanovdb_convert"):
        pytest.skip("python3-openvdb / nanovdb_convert missing for the round trip")
    back = tmp_path / "back.vdb"
    r = subprocess.run(["nanovdb_convert", str(path), str(back)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = read_vdb(back)
    for layer in ("tsdf", "esdf"):
        ref_ijk, ref_v = oracle(lidar_map, layer)
        ijk, v = sorted_voxels(got[layer]["ijk"], got[layer]["values"])
        np.testing.assert_array_equal(ijk, ref_ijk)
        np.testing.assert_array_equal(v, ref_v)


# ----------------------------------------------------------------------------------- route and CLI
def test_export_route_and_cli(tmp_path, lidar_map, capsys):
    from mapper.cli import main

    with client(tmp_path) as c:
        r = c.post("/v1/maps", json={"name": "vdbmap", "voxel_size_m": 0.25, "esdf_max_distance_m": 1.0})
        mid = r.json()["id"]
        for i in range(2):
            r = c.post(
                f"/v1/maps/{mid}/frames", content=frame_bytes(i), headers={"content-type": wire.MSGPACK}
            )
            assert r.status_code == 200, r.text
        ref = lidar_map  # the same frames and configuration
        for layer in ("tsdf", "esdf"):
            r = c.get(f"/v1/maps/{mid}/export", params={"format": "nvdb", "layer": layer})
            assert r.status_code == 200 and f"vdbmap-{layer}.nvdb" in r.headers["content-disposition"]
            p = parse_nvdb(r.content)[layer]
            ijk, v = sorted_voxels(p["ijk"], p["values"])
            ref_ijk, ref_v = oracle(ref, layer)
            np.testing.assert_array_equal(ijk, ref_ijk)
            np.testing.assert_allclose(v, ref_v, atol=1e-6)
        r = c.get(f"/v1/maps/{mid}/export", params={"format": "vdb", "layer": "tsdf"})
        assert r.status_code == 200 and r.content[:8] == struct.pack("<q", 0x56444220)
        if have_openvdb():
            (tmp_path / "route.vdb").write_bytes(r.content)
            g = read_vdb(tmp_path / "route.vdb")["tsdf"]
            assert g["active"] == oracle(ref, "tsdf")[0].shape[0]
        assert c.get(f"/v1/maps/{mid}/export", params={"format": "obj"}).status_code == 422
        assert c.get(f"/v1/maps/{mid}/export", params={"format": "vdb", "layer": "color"}).status_code == 422
        r = c.post("/v1/maps", json={"name": "tonly", "voxel_size_m": 0.25, "layers": ["tsdf"]})
        r = c.get(f"/v1/maps/{r.json()['id']}/export", params={"format": "vdb", "layer": "esdf"})
        assert r.status_code == 422 and "no 'esdf' layer" in r.json()["detail"]
        assert c.get(f"/v1/maps/{mid}/export").content[:8] != struct.pack("<q", 0x56444220)  # the snapshot
    # offline, from the data directory the service left (the CLI in this process: mapper.cli.main)
    out = tmp_path / "cli.nvdb"
    cmd = ["export", "--data-dir", str(tmp_path / "data"), "--map", "vdbmap", "--device", "cpu"]

    def run(*args) -> int:
        with pytest.raises(SystemExit) as e:
            main([*cmd, *args])
        return e.value.code

    assert run("--format", "nvdb", "--layer", "tsdf", "--out", str(out)) == 0
    p = parse_nvdb(out.read_bytes())["tsdf"]
    ijk, v = sorted_voxels(p["ijk"], p["values"])
    np.testing.assert_array_equal(ijk, oracle(ref, "tsdf")[0])
    capsys.readouterr()
    assert run("--format", "vdb") == 2
    err = capsys.readouterr().err
    assert "--out" in err and "Traceback" not in err
    assert run("--format", "zzz", "--out", "x") == 2
    assert "invalid choice" in capsys.readouterr().err
