"""Committed files name no path of the machine they were written on: no home-folder path (a cache, an output folder)
anywhere users read, and no absolute path as the base model that a committed adapter or run claims."""

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
