"""The set-up scripts: the transformers-4.57 venv (scripts/tf457_venv.sh) finds the caller's packages, torch among
them, whatever the caller's Python is (the system's, a venv's), and its own transformers comes first.

The caller here is a fresh venv holding a probe module and a stand-in ``transformers`` 5.x; the 4.57 venv is made
with ``--link-only`` (no network), and a stand-in ``transformers`` 4.57 is put in its own site-packages, as pip
would. The full install (pip, transformers 4.57 from PyPI) is what ``scripts/test.sh`` runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "tf457_venv.sh"

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the set-up scripts are bash")


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def _fake_transformers(site: Path, version: str) -> None:
    """A ``transformers`` package and its dist-info, as pip would leave them, that says which copy it is."""
    (site / "transformers").mkdir(parents=True, exist_ok=True)
    (site / "transformers" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    info = site / f"transformers-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformers\nVersion: {version}\n")


def _run_script(python: str | Path, venv: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": str(python)}
    return subprocess.run(["bash", str(SCRIPT), str(venv), "--link-only", *extra], env=env, capture_output=True,
                          text=True, timeout=300)


def _probe(python: Path) -> dict:
    code = textwrap.dedent("""
        import importlib.metadata, json, sys
        import transformers
        found = {"transformers": transformers.__version__, "metadata": importlib.metadata.version("transformers"),
                 "path": sys.path}
        try:
            import caller_probe
            found["caller_probe"] = caller_probe.WHERE
        except ImportError:
            found["caller_probe"] = None
        print(json.dumps(found))
    """)
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def caller_venv(tmp_path_factory) -> Path:
    """A fresh venv (no pip, nothing installed) with a probe module and a stand-in transformers 5.x."""
    root = tmp_path_factory.mktemp("caller") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = _site_packages(root / "bin" / "python")
    (site / "caller_probe.py").write_text("WHERE = 'the caller venv'\n")
    _fake_transformers(site, "5.99.0")
    return root


def test_tf457_venv_sees_a_venv_callers_packages_after_its_own(caller_venv, tmp_path):
    sub = tmp_path / "tf457"
    result = _run_script(caller_venv / "bin" / "python", sub)
    assert result.returncode == 0, result.stderr
    sub_python = sub / "bin" / "python"
    caller_site = str(_site_packages(caller_venv / "bin" / "python"))
    sub_site = _site_packages(sub_python)

    # Before the venv has its own transformers, the caller's is what it sees: the caller's folder is linked.
    found = _probe(sub_python)
    assert found["caller_probe"] == "the caller venv"
    assert found["transformers"] == "5.99.0"

    # pip puts transformers 4.57 in the venv's own site-packages; that copy wins, for imports and for metadata.
    _fake_transformers(sub_site, "4.57.99")
    found = _probe(sub_python)
    assert (found["transformers"], found["metadata"]) == ("4.57.99", "4.57.99")
    assert found["caller_probe"] == "the caller venv"
    assert found["path"].index(str(sub_site)) < found["path"].index(caller_site)

    # Running it again (scripts/test.sh does, every time) keeps the venv and its packages.
    again = _run_script(caller_venv / "bin" / "python", sub)
    assert again.returncode == 0, again.stderr
    assert _probe(sub_python)["transformers"] == "4.57.99"


def test_tf457_venv_finds_torch_from_the_python_running_the_tests(tmp_path):
    """The system Python in CI, a venv's python when the suite runs in one: the 4.57 venv imports its torch."""
    sub = tmp_path / "tf457"
    result = _run_script(sys.executable, sub)
    assert result.returncode == 0, result.stderr
    out = subprocess.run([str(sub / "bin" / "python"), "-c", "import torch, pytest; print(torch.__file__)"],
                         capture_output=True, text=True, check=True)
    import torch

    assert Path(out.stdout.strip().splitlines()[-1]).resolve() == Path(torch.__file__).resolve()


def test_tf457_venv_refuses_its_own_python_and_a_folder_that_is_not_a_venv(caller_venv, tmp_path):
    sub = tmp_path / "tf457"
    assert _run_script(caller_venv / "bin" / "python", sub).returncode == 0
    own = _run_script(sub / "bin" / "python", sub)
    assert own.returncode != 0 and "own python" in own.stderr

    folder = tmp_path / "not-a-venv"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    refused = _run_script(caller_venv / "bin" / "python", folder)
    assert refused.returncode == 1 and "not a venv" in refused.stderr
    assert (folder / "keep.txt").read_text() == "mine"


def test_tf457_venv_rejects_an_unknown_option(tmp_path):
    result = _run_script(sys.executable, tmp_path / "tf457", "--bogus")
    assert result.returncode == 2 and "unknown option --bogus" in result.stderr
    assert not (tmp_path / "tf457").exists()
