"""`kvhub db upgrade` from a plain wheel install: the migrations travel inside the wheel, under the kvhub
package (kvhub._migrations, kvhub._registry), never as top-level `migrations` / `registry` modules.

Builds a wheel and a venv in ~5-10 s on 2 cores, without network (``--no-index``).  The fresh venv gets kvhub only from the wheel; its dependencies come from this environment's
site-packages through a .pth file, so nothing is downloaded (and no CUDA torch can be pulled).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*command, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result


def _build_wheel(tmp_path: Path) -> Path:
    """Build from a copy of the sources, so the shared checkout gets no build/ or egg-info."""
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("kvhub", "migrations", "registry"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, source / name)
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-w",
        tmp_path / "dist",
        source,
        cwd=tmp_path,
    )
    [wheel] = (tmp_path / "dist").glob("kvhub-*.whl")
    return wheel


def _fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=tmp_path)
    site = Path(purelib.stdout.strip())
    (site / "deps-from-test-env.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel, cwd=tmp_path)
    return venv


def test_wheel_holds_registry_and_migrations_inside_kvhub_only(tmp_path):
    import zipfile

    names = zipfile.ZipFile(_build_wheel(tmp_path)).namelist()
    assert {name.split("/")[0] for name in names} == {"kvhub", "kvhub-0.1.0.dist-info"}
    for member in (
        "kvhub/_registry/models.toml",
        "kvhub/_registry/calibration/legal-docs.toml",
        "kvhub/_migrations/env.py",
        "kvhub/_migrations/alembic.ini",
        "kvhub/_migrations/script.py.mako",
        "kvhub/_migrations/versions/0001_initial_schema.py",
    ):
        assert member in names, member
    configs = [name for name in names if name.startswith("kvhub/_registry/configs/")]
    assert configs and all(name.endswith(".json") for name in configs)


def test_db_upgrade_works_from_an_installed_wheel(tmp_path):
    wheel = _build_wheel(tmp_path)
    venv = _fresh_venv(tmp_path, wheel)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVHUB_DB_URL")}
    env["KVHUB_HOME"] = str(tmp_path / "home")
    work = tmp_path / "elsewhere"  # not the checkout: nothing may be imported from it
    work.mkdir()
    where = (
        "import importlib.util, kvhub, kvhub._migrations, kvhub._registry; "
        "print(kvhub.__file__, kvhub._migrations.__file__, kvhub._registry.__file__); "
        "print(importlib.util.find_spec('migrations'), importlib.util.find_spec('registry'))"
    )
    located, top_level = _run(venv / "bin" / "python", "-c", where, cwd=work, env=env).stdout.splitlines()
    assert all(path.startswith(str(venv)) for path in located.split()), located
    assert top_level == "None None", f"the wheel installs top-level modules: {top_level}"

    db = f"sqlite:///{tmp_path / 'fresh.db'}"
    upgraded = _run(venv / "bin" / "kvhub", "db", "upgrade", "--db", db, cwd=work, env=env)
    assert "upgraded" in upgraded.stderr
    current = json.loads(_run(venv / "bin" / "kvhub", "db", "current", "--json", "--db", db, cwd=work, env=env).stdout)
    assert current["up_to_date"] is True and current["current"] == current["head"]
    listed = _run(venv / "bin" / "kvhub", "list", "--json", "--db", db, cwd=work, env=env)
    assert json.loads(listed.stdout) == []
