"""The installable distribution: a regular install (a wheel, not `pip install -e`) holds what the code reads."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest

from dxr.docs import ROOT

# Top-level folders that only a checkout needs: the suite, the benchmark scripts, the docs and CI.
CHECKOUT_ONLY = {"tests", "benchmarks", "docs", ".ci"}


def test_a_wheel_holds_every_tracked_file_of_the_folders_the_code_runs_from(tmp_path):
    # Prompt templates are read from `prompts/` beside the packages; a wheel without them installed
    # a dxr whose Direct Forecast (and so `dxr demo`) found no prompt.
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    tracked = [name for name in listed.stdout.decode().split("\0") if name]
    # Build from a copy, so the build's scratch (build/, *.egg-info) never lands in the checkout.
    source = tmp_path / "source"
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-c", "from setuptools import build_meta; print(build_meta.build_wheel('../wheel'))"],
        cwd=source, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = tmp_path / "wheel" / built.stdout.splitlines()[-1]
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    runtime = {name for name in tracked if "/" in name and name.split("/")[0] not in CHECKOUT_ONLY}
    assert "prompts/direct_forecast.toml" in runtime
    assert sorted(runtime - in_wheel) == []
