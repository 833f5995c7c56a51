"""The package a user installs from a wheel carries what `anytime eval` needs: the benchmark registry
ships inside it, so the default registry works outside this checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_anytime_eval_with_the_default_registry_runs_from_a_wheel_installed_elsewhere(tmp_path, tiny_model_dir,
                                                                                     math_data_dir):
    source = tmp_path / "source"   # a copy: setuptools builds in the source folder (build/, *.egg-info)
    shutil.copytree(REPO / "anytime", source / "anytime", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("anytime-*.whl"))
    assert "anytime/data/benchmarks.yaml" in zipfile.ZipFile(wheel).namelist()
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    # outside the checkout, with the checkout off the path: only the installed copy can be imported
    env = {k: v for k, v in os.environ.items() if k not in ("ANYTIME_BENCHMARKS", "PYTHONPATH")}
    env["PYTHONPATH"] = str(site)
    out = tmp_path / "eval"
    code = ("import sys, anytime, anytime.cli; assert anytime.__file__.startswith(sys.argv[1]), anytime.__file__; "
            "sys.exit(anytime.cli.main(sys.argv[2:]))")
    run = subprocess.run([sys.executable, "-c", code, str(site), "eval", "--model", tiny_model_dir,
                          "--benchmarks", "math500", "--data-dir", str(math_data_dir), "--limit", "2",
                          "--budgets", "8,16", "--temperature", "0", "--engine", "hf", "--summary-max-tokens", "4",
                          "--max-prompt-len", "2000", "--dtype", "float32", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["models"][tiny_model_dir]["math500"]["problems"] == 2
