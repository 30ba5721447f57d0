"""The bench shell scripts: each parses (``bash -n``), and the card's part names are checked before anything runs.

``bench/card_smollm2.sh PART`` starts hours of work in the background, so a mistyped part must stop at once, in
one line that lists the parts, before the fine-tuned model is merged or any card is loaded; and the parts its
header documents must be the parts it runs.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.sh")))
def test_each_bench_shell_script_parses(script):
    done = subprocess.run(["bash", "-n", str(BENCH / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _parts() -> list[str]:
    text = (BENCH / "card_smollm2.sh").read_text()
    (parts,) = re.findall(r'^PARTS="([^"]+)"', text, flags=re.M)
    return parts.split("|")


def test_the_card_script_refuses_an_unknown_part_before_anything_runs(tmp_path):
    # run from an empty folder: a part that went on would fail to find the merge script, not print the usage line
    done = subprocess.run(["bash", str(BENCH / "card_smollm2.sh"), "countng"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=30)
    assert done.returncode == 2
    assert done.stderr.strip() == f"unknown part countng ({'|'.join(_parts())})"
    assert list(tmp_path.iterdir()) == []
    done = subprocess.run(["bash", str(BENCH / "card_smollm2.sh")], capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert done.returncode != 0 and "part:" in done.stderr


def test_the_card_scripts_header_documents_every_part_it_runs():
    text = (BENCH / "card_smollm2.sh").read_text()
    header = text[: text.index("set -uo pipefail")]
    documented = re.findall(r"^#   ([a-z0-9-]+)\s{2,}", header, flags=re.M)
    # a part's branch: "part) card ..." on one line, or "part|part)" with its commands on the lines below
    run = [p for labels in re.findall(r"^([a-z0-9|-]+)\)(?:\s+card |\s*$)", text, flags=re.M) for p in labels.split("|")]
    run += ["combine", "floor"]
    assert sorted(documented) == sorted(_parts()) == sorted(run)


def test_the_gpu_card_stage_keeps_an_earlier_warm_calls_samples(tmp_path):
    """Each call to the device machine gets a fresh copy of the working tree; ignored .gpu_carry/ stays while the
    machine is warm. The card stage puts an earlier call's card folder back from there, so that the second call's
    card.tgz holds both calls' samples (run 18 lost a row's cell without this). The card itself is a stub here."""
    import tarfile

    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "gpu_session.sh").write_text((BENCH / "gpu_session.sh").read_text())
    stub = tmp_path / "stub-python"
    stub.write_text('#!/usr/bin/env bash\n# writes one sample file more into --out, as a card call that added a cell\n'
                    '# and one RULER sample file more into --sample-cache, as a call that generated samples\n'
                    'out=""; cache=""; while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2\n'
                    '  [ "$1" = --sample-cache ] && cache=$2; shift; done\n'
                    'mkdir -p "$out/ruler"; n=$(ls "$out/ruler" | wc -l); echo x > "$out/ruler/s$n.jsonl"\n'
                    'echo "gpu $n" > "$cache/gpu-key-$n.json"\n')
    stub.chmod(0o755)
    held, samples = [], []
    for call in (1, 2):
        tree = tmp_path / "bench" / "results"
        subprocess.run(["rm", "-rf", str(tree)], check=True)  # the tree each call gets holds no earlier call's results
        (tree / "card" / "ruler-samples").mkdir(parents=True)  # ... but the committed (CPU) sample cache
        (tree / "card" / "ruler-samples" / "cpu key.json").write_text("committed")
        done = subprocess.run(["bash", "bench/gpu_session.sh", "card", str(tmp_path / f"out{call}")], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", "PYTHON": str(stub), "HF_POSEXT_SMOLLM2_GGUF": "unused",
                                   "CARD_ROWS": "a=m@none"})
        assert done.returncode == 0, done.stderr
        with tarfile.open(tmp_path / f"out{call}" / "card.tgz") as archive:
            held.append(sorted(Path(n).name for n in archive.getnames() if n.endswith(".jsonl")))
        with tarfile.open(tmp_path / f"out{call}" / "card-samples.tgz") as archive:
            samples.append(sorted(Path(n).name for n in archive.getnames() if n.endswith(".json")))
    assert held == [["s0.jsonl"], ["s0.jsonl", "s1.jsonl"]]
    # the samples this machine generated come back, those the tree brought do not
    assert samples == [["gpu-key-0.json"], ["gpu-key-0.json", "gpu-key-1.json"]]


def test_the_card_floor_part_runs_each_command_card_floor_lists_with_its_settings_then_combines(tmp_path):
    """`bash bench/card_smollm2.sh floor`: combine, then every line of `card_floor.py --commands`, in order and each
    with its own settings (a failing one does not stop the rest), then combine again. Python is a stub that logs its
    calls; the listed commands are the script's own `combine`, so nothing loads a model."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "card_smollm2.sh").write_text((BENCH / "card_smollm2.sh").read_text())
    log = tmp_path / "calls.log"
    stub = tmp_path / "stub-python"
    stub.write_text('#!/usr/bin/env bash\n'
                    f'echo "${{TASKS:--}} $*" >> {log}\n'
                    'if [ "$*" = "bench/card_floor.py --commands" ]; then\n'
                    '  echo "TASKS=first bash bench/card_smollm2.sh combine"; echo "TASKS=second bash bench/card_smollm2.sh combine"; fi\n'
                    '[ "${TASKS:-}" = first ] && [ "$1" = -m ] && exit 1\n'  # the first command's combine fails
                    'exit 0\n')
    stub.chmod(0o755)
    done = subprocess.run(["bash", "bench/card_smollm2.sh", "floor"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": str(stub)})
    assert done.returncode == 0, done.stderr
    calls = [line.split(" ", 1) for line in log.read_text().splitlines()]
    combine = ["-m hf_posext.cli report", "bench/card_floor.py --card"]
    kinds = [(tasks, next((c for c in [*combine, "bench/card_floor.py --commands"] if args.startswith(c)), args)) for tasks, args in calls]
    assert kinds == [("-", combine[0]), ("-", combine[1]), ("-", "bench/card_floor.py --commands"),
                     ("first", combine[0]),  # failed: its card_floor is not reached, and the next command still runs
                     ("second", combine[0]), ("second", combine[1]), ("-", combine[0]), ("-", combine[1])]
    assert "floor: TASKS=first bash bench/card_smollm2.sh combine stopped with status 1" in done.stderr
