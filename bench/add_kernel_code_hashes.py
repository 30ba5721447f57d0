"""Give stored attention-method cells the docstring-blind kernel hash, from the git history that wrote them.

Cells of an attention-level method (STRING, DCA, Self-Extend) record ``kernel_sha256``: a hash of the
attention package's source files. Before ``kernel_code_sha256`` existed (a hash of the syntax trees,
docstrings removed; :func:`hf_posext.evaluation.fingerprints.kernel_code_hash`), any edit of that package,
a rewrapped docstring too, made every stored cell stale: the next evaluation recomputed hours of trials.

This script finds, for each such cell, the commit of the package whose sources hash to the cell's
``kernel_sha256``, and adds that commit's ``kernel_code_sha256``. A cell whose source hash matches no commit
(code that was never committed) is left as it is and listed, so it is still recomputed when its code
differs from today's. Files are rewritten atomically, and only when a cell changed.

Usage (from the repository root, with git)::

    python bench/add_kernel_code_hashes.py bench/results/long4x
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from hf_posext.evaluation.fingerprints import kernel_code_hash, kernel_source_hash

PACKAGE = "hf_posext/backends/attention"


def package_sources(commit: str, package: str) -> dict[str, bytes]:
    """The package's ``.py`` files at ``commit``, by file name."""
    listed = subprocess.check_output(["git", "ls-tree", "--name-only", commit, f"{package}/"], text=True).split()
    return {Path(path).name: subprocess.check_output(["git", "show", f"{commit}:{path}"])
            for path in listed if path.endswith(".py")}


def code_hash_by_source_hash(package: str) -> dict[str, str]:
    """``kernel_sha256 -> kernel_code_sha256`` for every committed version of the package and the working tree."""
    hashes: dict[str, str] = {}
    commits = subprocess.check_output(["git", "log", "--format=%H", "--", package], text=True).split()
    versions = [package_sources(commit, package) for commit in commits]
    versions.append({path.name: path.read_bytes() for path in sorted(Path(package).glob("*.py"))})
    for sources in versions:
        code = kernel_code_hash(sources)
        if sources and code is not None:
            hashes[kernel_source_hash(sources)] = code
    return hashes


def add_code_hashes(path: Path, hashes: dict[str, str]) -> tuple[int, list[str]]:
    """Add ``kernel_code_sha256`` to the cells of one results file; (cells changed, cells with unknown code)."""
    data = json.loads(path.read_text())
    changed, unknown = 0, []
    for cell_id, cell in data.get("cells", {}).items():
        attention = cell.get("attention_function")
        if not isinstance(attention, dict) or attention.get("kernel_code_sha256"):
            continue
        code = hashes.get(attention.get("kernel_sha256"))
        if code is None:
            unknown.append(cell_id)
            continue
        attention["kernel_code_sha256"] = code
        changed += 1
    if changed:
        staged = path.with_name(f".{path.name}.tmp")
        staged.write_text(json.dumps(data, indent=1, default=str))
        staged.replace(path)
    return changed, unknown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="results folders (their *.json files are read)")
    parser.add_argument("--package", default=PACKAGE, help=f"the attention package, from the repository root ({PACKAGE})")
    args = parser.parse_args()
    hashes = code_hash_by_source_hash(args.package)
    print(f"{len(hashes)} versions of {args.package} known from git")
    for folder in args.folders:
        for path in sorted(folder.glob("*.json")):
            changed, unknown = add_code_hashes(path, hashes)
            if changed or unknown:
                print(f"{path}: {changed} cell(s) given their code hash"
                      + (f"; no commit has the code of {len(unknown)}: {', '.join(unknown)}" if unknown else ""))


if __name__ == "__main__":
    main()
