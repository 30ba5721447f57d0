"""Every recipe's header (the comment at the top of its YAML) is true, and recipes/README.md lists every recipe.

- The header's launch command names the recipe's own file; every accelerate config, recipe or result it names exists;
  a header that says one process launches one process.
- A recipe's name says what it does: ``TARGET-WHAT-HARDWARE.yaml`` (``32k-stage1-books-cpu.yaml``), and its output
  folder is named after it: ``runs/MODEL-NAME``.
- Only the headline recipe is called the headline: a header sentence that says "headline" names the headline's
  files, and the headline's figures are the README's.
- recipes/README.md has one row per recipe; a measured row links a result file that exists, a NOT RUN row gives its
  GPU-hours, and a header that says NOT RUN is NOT RUN there.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "recipes" / "configs"
RECIPES = sorted(CONFIGS.glob("*/*.yaml"))
TABLE = (REPO / "recipes" / "README.md").read_text(encoding="utf-8")

#: The headline fine-tune: its stage 2 and the stage 1 it continues.
HEADLINE = "smollm2-135m/32k-stage2-lookups-and-counting-cpu.yaml"
HEADLINE_FILES = {"32k-stage2-lookups-and-counting-cpu.yaml", "32k-stage1-books-cpu.yaml"}
HARDWARE_WORDS = ("cpu", "1gpu", "8gpu")


def _header(path: Path) -> str:
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return "\n".join(lines)


def _launch_commands(header: str) -> list[str]:
    """The header's commands (``hf-posext train`` / ``accelerate launch``), backslash continuations joined."""
    joined = re.sub(r"\\\n\s*", " ", header)
    return [line.strip() for line in joined.splitlines()
            if re.search(r"\b(hf-posext train|accelerate launch)\b", line) and "--config" in line]


def _rel(path: Path) -> str:
    return path.relative_to(CONFIGS).as_posix()


@pytest.mark.parametrize("path", RECIPES, ids=_rel)
def test_the_launch_command_names_this_recipe_and_existing_files(path):
    header = _header(path)
    commands = _launch_commands(header)
    own = f"recipes/configs/{_rel(path)}"
    assert any(own in command for command in commands), f"{own}: no launch command in its header names it"
    for command in commands:
        for config_file in re.findall(r"--config_file\s+(\S+)", command):
            assert (REPO / config_file).is_file(), f"{own}: launch names {config_file}, which does not exist"
    for named in re.findall(r"recipes/(?:configs|accelerate)/[\w./-]+\.yaml", header):
        assert (REPO / named).is_file(), f"{own}: header names {named}, which does not exist"
    for bare in set(re.findall(r"(?<![/\w.*-])([\w.-]+\.yaml)\b", header)):
        assert (path.parent / bare).is_file() or (REPO / "recipes" / "accelerate" / bare).is_file(), \
            f"{own}: header names {bare}, which is neither a recipe beside it nor an accelerate config"
    for other in re.findall(r"(?<![/\w.-])([\w.-]+/[\w.-]+\.yaml)\b", header):
        assert (CONFIGS / other).is_file(), f"{own}: header names {other}, which is not a recipe"
    for result in re.findall(r"bench/results/[\w./-]+", header):
        assert (REPO / result.rstrip(".,;)")).exists(), f"{own}: header names {result}, which does not exist"


@pytest.mark.parametrize("path", RECIPES, ids=_rel)
def test_a_header_that_says_one_process_launches_one(path):
    header = _header(path)
    if "one process" not in header:
        return
    for command in _launch_commands(header):
        if f"recipes/configs/{_rel(path)}" not in command or "accelerate launch" not in command:
            continue
        for config_file in re.findall(r"--config_file\s+(\S+)", command):
            processes = yaml.safe_load((REPO / config_file).read_text()).get("num_processes", 1)
            assert processes == 1, f"{_rel(path)}: says one process, launches {config_file} ({processes} processes)"
        match = re.search(r"--num_processes\s+(\d+)", command)
        assert match is None or match.group(1) == "1", f"{_rel(path)}: says one process, launches {match.group(1)}"


@pytest.mark.parametrize("path", RECIPES, ids=_rel)
def test_the_name_says_its_target_and_hardware_and_the_output_folder_is_named_after_it(path):
    assert re.fullmatch(r"(\d+k|ci)(-[a-z0-9.]+)+-(" + "|".join(HARDWARE_WORDS) + ")", path.stem), \
        f"{_rel(path)}: not TARGET-WHAT-HARDWARE (e.g. 32k-stage1-books-cpu.yaml)"
    output = yaml.safe_load(path.read_text())["output"]["dir"]
    assert output == f"runs/{path.parent.name}-{path.stem}", \
        f"{_rel(path)}: output.dir {output}, expected runs/{path.parent.name}-{path.stem}"


def _processes(command: str) -> int:
    """How many processes a launch command starts (``hf-posext train``: one)."""
    if "accelerate launch" not in command:
        return 1
    match = re.search(r"--num_processes\s+(\d+)", command)
    if match:
        return int(match.group(1))
    configs = re.findall(r"--config_file\s+(\S+)", command)
    return yaml.safe_load((REPO / configs[0]).read_text()).get("num_processes", 1) if configs else 1


@pytest.mark.parametrize("path", [p for p in RECIPES if p.stem.endswith(("-1gpu", "-8gpu"))], ids=_rel)
def test_the_launch_starts_as_many_processes_as_the_name_says_gpus(path):
    gpus = 1 if path.stem.endswith("-1gpu") else 8
    own = f"recipes/configs/{_rel(path)}"
    for command in _launch_commands(_header(path)):
        if own in command:
            assert _processes(command) == gpus, f"{_rel(path)}: {command!r} starts {_processes(command)} processes"


def test_the_old_recipe_names_lead_to_the_new_ones():
    """Every renamed recipe is in the alias table that ``hf-posext train`` reads, and recipes/README.md lists it."""
    from hf_posext.training.recipe_names import RENAMED_RECIPES

    for old, new in RENAMED_RECIPES.items():
        assert not (REPO / old).exists(), f"{old} is still there"
        assert (REPO / new).is_file(), f"{old} -> {new}, which does not exist"
        assert f"| `{Path(old).relative_to('recipes/configs').as_posix()}` | [{Path(new).name}]" in TABLE, \
            f"recipes/README.md's table of old names lacks {old}"


@pytest.mark.parametrize("path", RECIPES, ids=_rel)
def test_only_the_headline_recipe_is_called_the_headline(path):
    sentences = re.split(r"(?<=[.;:])\s+", " ".join(_header(path).split()))
    for sentence in sentences:
        if "headline" in sentence.lower() and _rel(path) != HEADLINE:
            assert any(name in sentence for name in HEADLINE_FILES) or _rel(path).endswith(
                "32k-stage1-books-cpu.yaml"), f"{_rel(path)} calls something the headline: {sentence!r}"


def test_the_headline_recipe_quotes_the_readme_figures():
    header = " ".join(_header(CONFIGS / HEADLINE).split())
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    row_values = re.findall(r"\*\*([\d./]+)\*\*", readme[readme.index("## Results"):readme.index("## Command line")])
    assert row_values, "the README's results table has no bold figures"
    for value in row_values:
        assert value in header, f"the headline recipe's header lacks the README's {value}"


def _table_rows() -> dict[str, str]:
    rows = {}
    for line in TABLE.splitlines():
        match = re.match(r"\| \[([\w./-]+\.yaml)\]\(configs/\1\) \|", line)
        if match:
            rows[match.group(1)] = line
    return rows


def test_the_recipes_readme_lists_every_recipe_once():
    assert sorted(_table_rows()) == sorted(_rel(path) for path in RECIPES)
    for line in TABLE.splitlines():
        if line.startswith("| ["):
            assert re.match(r"\| \[([\w./-]+\.yaml)\]\(configs/\1\) \|", line), f"malformed row: {line[:80]}"


@pytest.mark.parametrize("path", RECIPES, ids=_rel)
def test_the_status_is_measured_with_its_file_or_not_run_with_its_estimate(path):
    row = _table_rows()[_rel(path)]
    status = row.rstrip(" |").rsplit(" | ", 1)[1]
    header = _header(path)
    if status.startswith("measured"):
        links = re.findall(r"\]\(([^)]+\.json)\)", status)
        assert links, f"{_rel(path)}: measured, but no result file linked"
        for link in links:
            assert (REPO / "recipes" / link).resolve().is_file(), f"{_rel(path)}: {link} does not exist"
        assert re.search(r"\d{4}-\d{2}-\d{2}", status), f"{_rel(path)}: measured, but no date"
        assert "NOT RUN" not in header, f"{_rel(path)}: the table says measured, its header NOT RUN"
    elif status.startswith("NOT RUN"):
        assert re.search(r"[\d.]+ GPU-hours", status), f"{_rel(path)}: NOT RUN without its GPU-hours"
        assert "NOT RUN" in header or "Not run" in header, f"{_rel(path)}: NOT RUN here, its header does not say so"
    else:
        assert status.startswith("CI"), f"{_rel(path)}: status {status!r} is none of measured, NOT RUN, CI"
