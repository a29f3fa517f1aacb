"""The README's client example runs as written against a fresh server, using only what it defines."""

from __future__ import annotations

from pathlib import Path

from test_service_helpers import Server

README = Path(__file__).resolve().parents[1] / "README.md"
URL = "http://127.0.0.1:8000"


def _client_block() -> str:
    text = README.read_text()
    i = text.index(f'MapperClient("{URL}"')
    start = text.rindex("```python\n", 0, i) + len("```python\n")
    return text[start : text.index("```", i)]


def test_readme_client_example_runs_twice(tmp_path):
    code = _client_block()
    with Server(tmp_path / "data", tmp_path / "srv.log") as s:
        src = code.replace(URL, s.url)
        for _ in range(2):  # a second run finds the map by name instead of a 409
            ns: dict = {}
            exec(compile(src, "README.md", "exec"), ns)
            assert ns["ack"]["points_used"] > 0
            assert ns["d"].shape == (2,) and ns["observed"].shape == (2,)
            assert ns["png"][:8] == b"\x89PNG\r\n\x1a\n"
