"""The books folder a command reads by default is the repository's ``data/books`` (what a clone has), never a
folder beside the checkout; and the docs say so."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_quality_table_reads_the_repositorys_books_by_default():
    help_text = subprocess.run([sys.executable, str(REPO / "bench" / "quality_table.py"), "--help"], capture_output=True,
                               text=True, check=True, cwd=REPO).stdout
    default = Path(re.search(r"default: the repository's (\S+?);", " ".join(help_text.split())).group(1))
    assert default == REPO / "data" / "books" and default.is_dir() and any(default.glob("*.txt"))


def test_no_library_default_or_doc_points_beside_the_checkout():
    for path in [*REPO.joinpath("hf_posext").rglob("*.py"), *REPO.joinpath("docs").glob("*.md"), REPO / "README.md"]:
        assert "shared/data/books" not in path.read_text(encoding="utf-8"), f"{path.relative_to(REPO)} names ../shared/data/books"
