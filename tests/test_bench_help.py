"""Every bench/*.py answers ``--help`` (exit 0, a usage line) without importing torch, transformers or hf_posext.

bench/README.md tells a newcomer to read a script's ``--help`` before running it, so that must be cheap: a script
parses its arguments before it loads the heavy libraries (or imports them under ``if not HELP_ONLY:``). Each script
runs in a fresh interpreter, as ``python bench/NAME.py --help`` does (its folder first on ``sys.path``), with an
import hook that refuses those libraries, so a script that loads them for ``--help`` fails here by name instead of
making the check slow (measured 2026-12-02: 0.2-0.5 s a script this way, 4-22 s each when they loaded torch).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
HEAVY = ("torch", "transformers", "hf_posext", "peft", "accelerate")

#: Run one script as ``__main__`` with ``--help``; importing a heavy library raises instead of loading it.
_RUN_HELP = """
import importlib.abc, runpy, sys
HEAVY = {heavy!r}

class RefuseHeavy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            raise ImportError(f"bench script imported {{name}} to answer --help; parse the arguments first")
        return None

sys.meta_path.insert(0, RefuseHeavy())
script = {script!r}
sys.argv = [script, "--help"]
sys.path.insert(0, {folder!r})
runpy.run_path(script, run_name="__main__")
"""


def bench_scripts() -> list[Path]:
    return sorted(BENCH.glob("*.py"))


def test_there_are_bench_scripts():
    assert len(bench_scripts()) >= 10


@pytest.mark.parametrize("script", bench_scripts(), ids=lambda path: path.name)
def test_help_exits_0_without_loading_torch(script):
    code = _RUN_HELP.format(heavy=HEAVY, script=str(script), folder=str(script.parent))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=BENCH.parent)
    assert done.returncode == 0, f"python bench/{script.name} --help exited {done.returncode}:\n{done.stderr[-2000:]}"
    assert "usage:" in done.stdout, f"python bench/{script.name} --help printed no usage line:\n{done.stdout[:500]}"


def unlisted_in_readme(readme: str, folder: Path = BENCH) -> list[str]:
    """The bench scripts (``*.py``, ``*.sh``, ``*.mjs``) and results folders that bench/README.md never names.

    A newcomer finds a benchmark through that README's tables, so a script or a results folder it does not name is
    one nobody will run or read.
    """
    scripts = [path.name for pattern in ("*.py", "*.sh", "*.mjs") for path in sorted(folder.glob(pattern))]
    results = [f"{path.name}/" for path in sorted((folder / "results").iterdir()) if path.is_dir()]
    return [name for name in scripts if name not in readme] + [name for name in results if name not in readme]


def test_bench_readme_names_every_script_and_results_folder():
    missing = unlisted_in_readme((BENCH / "README.md").read_text(encoding="utf-8"))
    assert missing == [], f"bench/README.md does not name: {', '.join(missing)}; add a row for each"


def test_an_unlisted_script_is_found(tmp_path):
    (tmp_path / "results" / "listed").mkdir(parents=True)
    (tmp_path / "results" / "forgotten").mkdir()
    (tmp_path / "listed.py").write_text("")
    (tmp_path / "forgotten.sh").write_text("")
    readme = "| q | `python bench/listed.py` | [`listed/`](results/listed/) |"
    assert unlisted_in_readme(readme, tmp_path) == ["forgotten.sh", "forgotten/"]
