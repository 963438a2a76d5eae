"""benchmarks/common.save_json: results are written whole or not at all (a run killed at a device deadline, or a
payload that cannot be written, leaves the previous file as it was and no temporary file behind)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import save_json  # noqa: E402


def test_writes_and_replaces_whole_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "deep" / "tau.json"
    save_json(out, {"rows": [1], "complete": False}, quiet=True)
    assert capsys.readouterr().out == ""
    assert json.loads(out.read_text()) == {"rows": [1], "complete": False}
    save_json(out, {"rows": [1, 2], "complete": True})
    assert f"wrote {out}" in capsys.readouterr().out
    assert json.loads(out.read_text()) == {"rows": [1, 2], "complete": True}
    assert sorted(p.name for p in out.parent.iterdir()) == ["tau.json"]


def test_a_payload_that_cannot_be_written_keeps_the_previous_file(tmp_path: Path) -> None:
    out = tmp_path / "tau.json"
    save_json(out, {"rows": [1]}, quiet=True)
    before = out.read_bytes()
    with pytest.raises(TypeError):
        save_json(out, {"rows": [object()]}, quiet=True)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tau.json"]
