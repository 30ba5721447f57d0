"""The bench scripts read the repository's ``data/books`` by default (what a clone has), found from the script's
place; the one that keeps the lab's path says why (committed results' keys hold it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


def test_the_bench_scripts_default_to_the_repositorys_books():
    for name in ("train_memory.py", "learned_table_extension.py", "train_throughput.py", "card_smollm2.sh"):
        assert "shared/data/books" not in (BENCH / name).read_text(), name
    help_text = subprocess.run([sys.executable, str(BENCH / "learned_table_extension.py"), "--help"], capture_output=True,
                               text=True, check=True, cwd="/").stdout
    assert f"default {REPO / 'data' / 'books'} when present" in " ".join(help_text.split())
    assert re.search(r'f"data\.source=\{REPO / .data. / .books.\}"', (BENCH / "train_throughput.py").read_text())
    assert 'return ROOT / "data" / "books"' in (BENCH / "train_memory.py").read_text()


def test_the_gpu_session_keeps_the_lab_path_and_says_why():
    lines = (BENCH / "gpu_session.sh").read_text().splitlines()
    default = next(i for i, line in enumerate(lines) if line.startswith("BOOKS=${BOOKS:-"))
    assert lines[default] == "BOOKS=${BOOKS:-/work/shared/data/books}"
    assert lines[default - 1].startswith("#") and "keys hold this literal path" in lines[default - 1]
