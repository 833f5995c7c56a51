"""`anytime schedule` (anytime/analysis/schedule_command.py)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from anytime.analysis import schedule_command as command
from anytime.pipeline import SCHEDULES


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    code = command.run(parser.parse_args(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.unit
def test_json_output(capsys) -> None:
    code, out, _ = _run(["zb-h1", "-p", "4", "-m", "8", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["schedule"] == "zb-h1" and data["stages"] == 4 and data["microbatches"] == 8
    assert data["chunks"] == 1 and data["placement"] == [0, 1, 2, 3]
    assert data["makespan"] == 27 and data["bubble_rate"] == pytest.approx(3 / 27)
    assert len(data["peak_memory"]) == 4 and data["peak_memory"][0] == 4
    assert data["actions"]["3"][:4] == ["3F0", "3I0", "3F1", "3I1"]


@pytest.mark.unit
def test_costs_and_chunks_flags(capsys) -> None:
    code, out, _ = _run(["interleaved-1f1b", "-p", "2", "-m", "4", "-v", "3", "--cost-f", "2",
                         "--cost-b", "2", "--cost-w", "2", "--cost-comm", "0.5", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["chunks"] == 3 and data["placement"] == [0, 1, 0, 1, 0, 1]
    assert data["makespan"] > 3 * 4 * 2  # at least the busy time with F=B=W=2


@pytest.mark.unit
def test_text_output_and_files(tmp_path, capsys) -> None:
    png, trace = tmp_path / "a.png", tmp_path / "a.json"
    code, out, _ = _run(["zb-v", "-p", "4", "-m", "8", "--plot", str(png), "--trace", str(trace)], capsys)
    assert code == 0
    assert "schedule zb-v: p=4 m=8 v=2" in out and "rank  3 |" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(trace.read_text())["traceEvents"]


@pytest.mark.unit
def test_compare_table(capsys) -> None:
    code, out, _ = _run(["compare", "-p", "4", "-m", "12"], capsys)
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:]}
    assert list(rows) == list(SCHEDULES.names())
    assert rows["1f1b"][2:6] == ["45.00", "20.0%", "4.00", "9.00"]
    assert rows["zb-v"][2:6] == ["37.50", "4.0%", "4.00", "0.00"]


@pytest.mark.unit
def test_compare_json_reports_unsupported_rows(capsys) -> None:
    code, out, _ = _run(["compare", "-p", "4", "-m", "13", "--json"], capsys)
    rows = {r["schedule"]: r for r in json.loads(out)}
    assert code == 0 and "divisible" in rows["interleaved-1f1b"]["error"]
    assert rows["zb-h1"]["makespan"] == 42


@pytest.mark.unit
def test_errors_exit_2_with_a_message(capsys) -> None:
    code, _, err = _run(["zb-auto", "-p", "4", "-m", "8", "--mem-limit", "0.5"], capsys)
    assert code == 2 and "below one microbatch" in err
    code, _, err = _run(["compare", "-p", "4", "-m", "8", "--plot", "x.png"], capsys)
    assert code == 2 and "--plot" in err


@pytest.mark.integration
def test_python_dash_m() -> None:
    proc = subprocess.run([sys.executable, "-m", "anytime.analysis.schedule_command", "1f1b", "-p", "2", "-m", "2",
                           "--json"], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(proc.stdout)["makespan"] == 9
