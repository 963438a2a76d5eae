"""benchmarks/common.save_json: results are written whole or not at all (a run killed at a device deadline, or a
payload that cannot be written, leaves the previous file as it was and no temporary file behind)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "benchmarks" / sub) for sub in ("", "dev")]
import common  # noqa: E402
import paired_runs  # noqa: E402
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


@pytest.mark.parametrize("device,bandwidth", [(None, None), ("NVIDIA H200", 4.26e12),
                                              ("NVIDIA H100 80GB HBM3", None), ("NVIDIA A100-SXM4-80GB", None)])
def test_the_copy_ceiling_is_quoted_only_for_the_gpu_it_was_measured_on(device: str | None,
                                                                          bandwidth: float | None,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Floors are bytes over the measured copy ceiling; an H100 run once recorded the H200's. Now any GPU without a
    measured ceiling (and the CPU) records none, and the benchmarks leave their floors out."""
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: device is not None)
    monkeypatch.setattr(common.torch.cuda, "get_device_name", lambda *a: device)
    assert common.copy_bandwidth() == bandwidth
    env = common.environment()
    assert env["copy_bandwidth_bytes_per_s"] == bandwidth and env["gpu"] == (device or "none (cpu)")


def _run(path: Path, values: dict[tuple[str, int | None], list[float]], task: str = "books") -> Path:
    """A quality JSON of one task at 1024 tokens: one record per (method key, budget) over samples s0, s1, ..."""
    metric = paired_runs.METRIC[task]
    records = [{"task": task, "context": 1024, "key": key, "budget": budget,
                "samples": [f"s{i}" for i in range(len(v))], "per_sample": [{metric: x} for x in v]}
               for (key, budget), v in values.items()]
    path.write_text(json.dumps({"records": records}))
    return path


def test_paired_runs_against_fullkv_and_the_base(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    full = [0.5, 0.25, 0.75, 0.5]
    base = _run(tmp_path / "base.json", {("classic", None): full, ("ip", 128): [0.25, 0.25, 0.5, 0.5]})
    other = _run(tmp_path / "r64.json", {("classic", None): [0.0] * 4, ("ip", 128): [0.5, 0.25, 0.75, 0.25]})
    cells = paired_runs.per_sample(other, "/r64")
    assert ("books", 1024, "classic", None) in cells and ("books", 1024, "ip/r64", 128) in cells
    mean, lo, hi, n = paired_runs.paired({"a": 0.5, "b": 0.25}, {"a": 0.25, "b": 0.25, "c": 1.0})
    assert (mean, n) == (12.5, 2) and 0.0 <= lo <= mean <= hi <= 25.0
    monkeypatch.setattr(sys, "argv", ["paired_runs.py", str(base), f"r64={other}"])
    paired_runs.main()
    lines = {line.split(" | ")[3]: line for line in capsys.readouterr().out.splitlines()[2:]}
    # ip minus FullKV: (-0.25, 0, -0.25, 0) -> -12.5; the other run's ip is measured against the base's FullKV rows
    # (its own, all 0, are ignored): (0, 0, 0, -0.25) -> -6.25, and minus the base's ip (0.25, 0, 0.25, -0.25) -> +6.25
    assert "| -12.5 [-25.0, +0.0] (n 4) |" in lines["ip"]
    assert "| -6.2 [" in lines["ip/r64"] and "(n 4) | +6.2 [" in lines["ip/r64"]
    with pytest.raises(SystemExit, match="share no sample"):
        paired_runs.paired({"a": 1.0}, {"b": 1.0})


def test_paired_runs_reads_a_base_split_over_files(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A base whose needle-new run is a file of its own: both files' FullKV rows are references."""
    base = _run(tmp_path / "base.json", {("classic", None): [0.5, 0.5], ("ip", 128): [0.5, 0.0]})
    new = _run(tmp_path / "new.json", {("classic", None): [1.0, 1.0], ("quest", 128): [1.0, 0.0]}, "needle-new")
    other = _run(tmp_path / "r64.json", {("classic", None): [1.0, 1.0], ("ip", 128): [1.0, 1.0]}, "needle-new")
    monkeypatch.setattr(sys, "argv", ["paired_runs.py", str(base), f"r64={other}"])
    with pytest.raises(SystemExit, match="no FullKV"):  # the one-file base has no needle-new reference
        paired_runs.main()
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["paired_runs.py", f"{base},{new}", f"r64={other}"])
    paired_runs.main()
    lines = {line.split(" | ")[0] + line.split(" | ")[3]: line for line in capsys.readouterr().out.splitlines()[2:]}
    # needle-new: ip/r64 minus FullKV (0, 0) -> +0.0; minus the base file 2's quest (0, 1) -> +50.0
    assert "| +0.0 [+0.0, +0.0] (n 2) |" in lines["| needle-newip/r64"]
    assert "quest: +50.0 [" in lines["| needle-newip/r64"]
    assert "| -25.0 [" in lines["| booksip"]
