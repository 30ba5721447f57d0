"""Give stored cells of a local model the ``original_window`` field that cells written before it existed lack.

Evaluation cells record ``original_window``: the loaded model's window before any scaling, from
:func:`hf_posext.describe`. The plots draw it as the dotted "original window" line. Cells written before the
field existed fall back to ``supported_window / factor``, which is wrong for a model whose config already
declares a scaled window (a merged fine-tune evaluated at factor 1: 32768 / 1 instead of 8192).

For each results file whose ``config.model`` is a local folder with a ``config.json``, this script builds
that model from its config (random weights: :func:`hf_posext.describe` reads only the position settings),
asks ``describe`` for its original window, the value the evaluation would have recorded, and adds it to the
cells that lack it. Other files (hub names, base model + adapter) are left as they are and listed.
Files are rewritten atomically, and only when a cell changed.

Usage (from the repository root)::

    python bench/add_original_windows.py bench/results/long4x
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import hf_posext


def original_window_of(model_folder: Path) -> int:
    """``describe(model).original_window`` for the model a local folder's ``config.json`` describes."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_folder)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return hf_posext.describe(model).original_window


def add_original_windows(path: Path, windows: dict[str, int]) -> tuple[int, str]:
    """Add ``original_window`` to the cells of one results file; (cells changed, the window given or why none was)."""
    data = json.loads(path.read_text())
    missing = [cell for cell in data.get("cells", {}).values() if not cell.get("original_window")]
    if not missing:
        return 0, ""
    model = str(data.get("config", {}).get("model", ""))
    if not (Path(model) / "config.json").is_file():
        return 0, f"{len(missing)} cell(s) lack it, and model {model!r} is not a local folder with a config.json"
    if model not in windows:
        windows[model] = original_window_of(Path(model))
    for cell in missing:
        cell["original_window"] = windows[model]
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(json.dumps(data, indent=1, default=str))
    staged.replace(path)
    return len(missing), f"original_window {windows[model]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="results folders (their *.json files are read)")
    args = parser.parse_args()
    windows: dict[str, int] = {}
    skipped: list[str] = []
    for folder in args.folders:
        for path in sorted(folder.glob("*.json")):
            changed, what = add_original_windows(path, windows)
            if changed:
                print(f"{path}: {changed} cell(s) given {what}")
            elif what:
                skipped.append(f"{path.name} ({what})")
    if skipped:
        print(f"{len(skipped)} file(s) left as they are; their plots fall back to supported_window / factor:\n  "
              + "\n  ".join(skipped))


if __name__ == "__main__":
    main()
