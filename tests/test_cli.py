"""The ``mapper`` command line: replay (offline and into a server), export, errors."""

from __future__ import annotations

import numpy as np
import pytest
from test_service_helpers import Server, scan

from mapper.cli import main
from mapper.client import MapperClient
from mapper.persistence import DataDir


def run(argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def make_kitti(root, n=3):
    (root / "velodyne").mkdir(parents=True)
    poses = []
    for i in range(n):
        pts, T = scan(i, 2000)
        np.hstack([pts, np.ones((len(pts), 1), np.float32)]).astype(np.float32).tofile(
            root / "velodyne" / f"{i:06d}.bin"
        )
        poses.append(T[:3].ravel())
    np.savetxt(root / "poses.txt", np.array(poses))
    (root / "calib.txt").write_text("Tr: " + " ".join(map(str, np.eye(4)[:3].ravel())) + "\n")
    return root


def test_replay_offline_then_export(tmp_path, capsys):
    kitti = make_kitti(tmp_path / "kitti")
    out = tmp_path / "maps"
    code, stdout, err = run(
        [
            "replay",
            "--format",
            "kitti",
            str(kitti),
            "--out",
            str(out),
            "--voxel",
            "0.25",
            "--name",
            "k",
            "--device",
            "cpu",
        ],
        capsys,
    )
    assert code == 0, err
    assert "replayed 3 lidar frames" in stdout and "stored in" in stdout and "3/3" in err
    assert len(DataDir(out).map_ids()) == 1
    code, stdout, err = run(
        [
            "export",
            "--data-dir",
            str(out),
            "--map",
            "k",
            "--slice",
            str(tmp_path / "s.png"),
            "--snapshot",
            str(tmp_path / "k.safetensors"),
            "--device",
            "cpu",
        ],
        capsys,
    )
    assert code == 0, err
    assert (tmp_path / "s.png").read_bytes().startswith(b"\x89PNG") and (
        tmp_path / "k.safetensors"
    ).stat().st_size
    with Server(out, tmp_path / "srv.log") as s, MapperClient(s.url) as c:  # the server serves --out maps
        assert c.find_map("k")["frames_integrated"] == 3


def test_replay_into_server(tmp_path, capsys, shared_data):
    with Server(tmp_path / "data", tmp_path / "srv.log") as s:
        code, stdout, err = run(
            [
                "replay",
                "--format",
                "norlab",
                str(shared_data / "norlab_lidar"),
                "--server",
                s.url,
                "--name",
                "lidar",
                "--voxel",
                "0.3",
                "--limit",
                "3",
            ],
            capsys,
        )
        assert code == 0, err
        assert "replayed 3 lidar frames" in stdout
        code, stdout, err = run(
            [
                "replay",
                "--format",
                "3dmatch",
                str(shared_data / "3dmatch_seq01"),
                "--server",
                s.url,
                "--name",
                "rgbd",
                "--voxel",
                "0.1",
                "--limit",
                "1",
                "--http",
                "--layers",
                "tsdf",
            ],
            capsys,
        )
        assert code == 0, err
        with MapperClient(s.url) as c:
            assert (
                c.find_map("lidar")["frames_integrated"] == 3 and c.find_map("rgbd")["frames_integrated"] == 1
            )
        code, stdout, err = run(
            ["export", "--server", s.url, "--map", "lidar", "--slice", str(tmp_path / "l.png")], capsys
        )
        assert code == 0, err and (tmp_path / "l.png").exists()


def test_cli_errors(tmp_path, capsys):
    code, _, err = run(["replay", "--format", "kitti", str(tmp_path), "--out", str(tmp_path / "o")], capsys)
    assert code == 1 and "velodyne" in err
    code, _, err = run(["export", "--data-dir", str(tmp_path), "--map", "none", "--slice", "x.png"], capsys)
    assert code == 1 and "not found" in err
    code, _, err = run(["serve", "--host", "10.1.2.3"], capsys)
    assert code == 2 and "refusing" in err


def test_foxglove_settings_from_env_and_flag(tmp_path, monkeypatch, capsys):
    """The Foxglove bridge's address is a setting: MAPPER_FOXGLOVE_PORT/HOST (empty = none), and
    ``serve --foxglove-port`` hands it to the app's settings without touching the environment."""
    import os

    import uvicorn
    from pydantic import ValidationError

    from mapper.settings import Settings

    monkeypatch.delenv("MAPPER_FOXGLOVE_PORT", raising=False)
    monkeypatch.delenv("MAPPER_FOXGLOVE_HOST", raising=False)
    assert Settings().foxglove_port is None and Settings().foxglove_host == "127.0.0.1"
    monkeypatch.setenv("MAPPER_FOXGLOVE_PORT", "8765")
    monkeypatch.setenv("MAPPER_FOXGLOVE_HOST", "0.0.0.0")
    s = Settings()
    assert (s.foxglove_port, s.foxglove_host) == (8765, "0.0.0.0")
    monkeypatch.setenv("MAPPER_FOXGLOVE_PORT", "")
    assert Settings().foxglove_port is None  # empty = no bridge, as before
    monkeypatch.setenv("MAPPER_FOXGLOVE_PORT", "70000")
    with pytest.raises(ValidationError, match="foxglove_port"):
        Settings()
    monkeypatch.delenv("MAPPER_FOXGLOVE_PORT")
    monkeypatch.delenv("MAPPER_FOXGLOVE_HOST")

    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.update(app=app, **kw))
    argv = ["serve", "--data-dir", str(tmp_path), "--device", "cpu", "--foxglove-port", "8799"]
    code, _, _ = run(argv, capsys)
    assert code == 0
    assert served["app"].state.settings.foxglove_port == 8799
    assert "MAPPER_FOXGLOVE_PORT" not in os.environ
