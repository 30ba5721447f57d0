"""Committed files name no path of the machine they were written on: no home-folder path (a cache, an output folder)
anywhere users read, no temporary or workspace folder (/tmp/..., /work/...) in the docs and committed results, and no
absolute path as the base model that a committed adapter or run claims."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: A home folder: /root/..., /home/NAME/..., /Users/NAME/... (not inside a longer path or a URL).
HOME_PATH = re.compile(r"(?<![\w./-])/(?:root|home/[\w.-]+|Users/[\w.-]+)/")
#: An absolute path of a machine (a home folder, a temporary folder, this workspace).
MACHINE_PATH = re.compile(r"^(?:/(?:root|home|Users|tmp|private|work|var|mnt)/|[A-Za-z]:\\)")
#: A temporary folder or this workspace where a path starts (not inside a longer path, a URL or after $TMPDIR).
SCRATCH_PATH = re.compile(r"(?<![\w./$-])/(?:tmp|work)/")


def committed(*patterns: str) -> list[Path]:
    names = subprocess.run(["git", "ls-files", "--", *patterns], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / name for name in names.splitlines() if not name.startswith("tests/") and (REPO / name).is_file()]


def test_no_committed_file_names_a_home_folder():
    found = []
    for path in committed():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        found += [f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in HOME_PATH.finditer(text)]
    assert not found, "home-folder paths (write them relative, or as the hub id / model name):\n" + "\n".join(found[:30])


def test_no_committed_adapter_or_run_claims_a_machine_path_as_its_base():
    claims = []
    for path in committed("*adapter_config.json"):
        claims.append((path, "base_model_name_or_path", json.loads(path.read_text()).get("base_model_name_or_path")))
    for path in committed("*posext_adapter.json"):
        claims.append((path, "base_model", json.loads(path.read_text()).get("base_model")))
    for path in committed("*train_config.yaml"):
        import yaml

        claims.append((path, "model.name", ((yaml.safe_load(path.read_text()) or {}).get("model") or {}).get("name")))
    for path in committed("*README.md"):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("base_model:"):
                claims.append((path, "base_model", line.partition(":")[2].strip()))
    bad = [f"{path.relative_to(REPO)}: {field} {value!r}" for path, field, value in claims
           if isinstance(value, str) and MACHINE_PATH.match(value)]
    assert claims and not bad, "\n".join(bad)


def _read_by_users_or_results(path: Path) -> bool:
    """Docs (every Markdown file, docs/, recipes/, eval/) and committed results (bench/results/); not code, whose
    defaults (TMPDIR or /tmp) are what it does."""
    name = path.relative_to(REPO).as_posix()
    if name.endswith((".py", ".sh")):
        return False
    return name.endswith(".md") or name.startswith(("docs/", "recipes/", "eval/", "bench/results/", "data/"))


def test_no_doc_or_committed_result_names_a_temporary_or_workspace_folder():
    """A results file, a run history or a doc that names /tmp/x or /work/x names a folder of the machine it ran on
    (data read from /work/shared/data/books is the repository's data/books; a scratch tree is $TMPDIR/x)."""
    found = []
    for path in committed():
        if not _read_by_users_or_results(path):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        found += [f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {text[m.start():m.start() + 40]!r}"
                  for m in SCRATCH_PATH.finditer(text)]
    assert not found, ("temporary or workspace paths (write data/books, a path relative to the repository, or "
                       "$TMPDIR/...):\n" + "\n".join(found[:40]))


def test_the_scan_finds_what_it_guards():
    assert SCRATCH_PATH.search('"data": "/work/shared/data/books"') and SCRATCH_PATH.search("--out /tmp/x")
    assert not SCRATCH_PATH.search("$TMPDIR/x https://example.org/tmp/x data/work/x")


def test_committed_results_stay_valid_json():
    for path in committed("bench/results/*.json"):
        json.loads(path.read_text(encoding="utf-8"))
