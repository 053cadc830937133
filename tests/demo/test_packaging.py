"""The wheel builds without setuptools warnings and carries the demo model and the LICENSE.

The demo's data folders used to be importable folders missing from ``packages``: every build
printed one "Package would be ignored" BuildBackendWarning per folder (six on the first
``./scripts/serve``). The build runs on a copy of the packaged files, with the environment's
own setuptools (no build isolation: nothing is downloaded), so the checkout is not written.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from loraplex.engine.demo import demo_adapters, demo_model_dir

ROOT = Path(__file__).resolve().parents[2]
PACKAGED = ("setup.py", "pyproject.toml", "README.md", "LICENSE")


def test_wheel_builds_without_warnings(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in PACKAGED:
        shutil.copy2(ROOT / name, src / name)
    for top in ("engine", "resolvers", "plugins"):
        skip = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(ROOT / top, src / top, ignore=skip)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    cmd += ["--no-cache-dir", "--no-index", "-w", str(tmp_path / "dist"), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Warning" not in out and "would be ignored" not in out, out[-3000:]

    (wheel,) = (tmp_path / "dist").glob("loraplex-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assets = demo_model_dir()
    expected = [p for p in assets.rglob("*") if p.is_file()]
    assert len(expected) >= 6 + 2 * len(demo_adapters())
    for path in expected:
        assert f"loraplex/engine/demo/assets/{path.relative_to(assets).as_posix()}" in names
