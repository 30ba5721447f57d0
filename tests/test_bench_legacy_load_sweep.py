"""``bench/legacy_load_sweep.py`` refuses bad arguments in one line, before it saves or loads any model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_export import TF457_PYTHON

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "legacy_load_sweep.py"


def _refusal(tmp_path: Path, *args: str) -> str:
    out = tmp_path / "sweep.json"
    result = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(out)], capture_output=True, text=True)
    assert result.returncode != 0 and not out.exists(), result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    return lines[0]


def test_a_missing_older_python_is_named_with_the_command_that_makes_it(tmp_path):
    assert "no such file; make the venv with" in _refusal(tmp_path, "--tf457-python", str(tmp_path / "python"))


def test_a_python_of_the_same_release_is_refused(tmp_path):
    assert "not 4.x: the sweep would compare a release with itself" in _refusal(tmp_path, "--tf457-python", sys.executable)


@pytest.mark.skipif(not TF457_PYTHON.exists(), reason="no transformers 4.57 venv (.venv-tf457, made by scripts/test.sh)")
@pytest.mark.parametrize("args, expected", [
    (["--classes", "LlamaForCausalLM,NoSuchForCausalLM"], "--classes: NoSuchForCausalLM is not a *ForCausalLM class"),
    (["--classes", "LlamaForCausalLM", "--methods", "yarn,yarnn"], "--methods: unknown yarnn; pick from"),
])
def test_an_unknown_class_or_method_is_refused_instead_of_swept_as_nothing(tmp_path, args, expected):
    assert expected in _refusal(tmp_path, "--tf457-python", str(TF457_PYTHON), *args)


def test_the_record_names_no_path_of_the_machine_it_ran_on():
    """Errors and tracebacks carry the saved folders' temporary root, the installed packages' folders and the
    repository's: the committed record writes them as SAVED, site-packages/ and repository-relative paths."""
    from tests.bench_helpers import load_bench_script

    sweep = load_bench_script("legacy_load_sweep")
    repo = str(SCRIPT.parents[1])
    record = {"rows": [{"error": "ValueError: /tmp/tmpab12/Olmo-yarn/config.json holds ...", "traceback": (
        f'File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1\n'
        f'File "{repo}/.venv-tf457/lib/python3.11/site-packages/transformers/x.py"\nFile "{repo}/hf_posext/api.py"')}]}
    row = sweep.portable(record, "/tmp/tmpab12")["rows"][0]
    assert row["error"] == "ValueError: SAVED/Olmo-yarn/config.json holds ..."
    assert row["traceback"] == ('File "site-packages/torch/nn/modules/module.py", line 1\n'
                                'File "site-packages/transformers/x.py"\nFile "hf_posext/api.py"')
