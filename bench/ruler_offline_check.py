"""Which RULER synthetic tasks of lm-eval[ruler] build offline here? One subprocess per task, no network.

    python bench/ruler_offline_check.py --out bench/results/lm_eval/ruler_offline.json

Each task is built (its samples generated) with SmolLM2's local tokenizer at one short length, with
``HF_HUB_OFFLINE=1`` and ``HF_DATASETS_OFFLINE=1``; a task that needs a download fails or times out.
Building is what needs the network: a task that builds runs under any model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multiquery", "niah_multivalue", "ruler_vt", "ruler_cwe", "ruler_fwe", "ruler_qa_squad", "ruler_qa_hotpot")

_BUILD = """
import json, sys
from lm_eval.tasks import TaskManager, get_task_dict
from hf_posext.models import resolve_model_path
path = resolve_model_path("smollm2-135m")
manager = TaskManager(metadata={"pretrained": path, "tokenizer": path, "max_seq_lengths": [int(sys.argv[2])]})
tasks = get_task_dict([sys.argv[1]], manager)
task = next(iter(tasks.values()))
docs = list(task.eval_docs) if hasattr(task, "eval_docs") else []
print(json.dumps({"docs": len(docs)}))
"""


def check(task: str, length: int, timeout: float) -> dict:
    """Build ``task`` offline in a fresh process; returns ``{"task", "ok", "seconds", "docs"|"error"}``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started = time.time()
    try:
        result = subprocess.run([sys.executable, "-c", _BUILD, task, str(length)], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"task": task, "ok": False, "seconds": round(time.time() - started, 1), "error": f"timed out after {timeout:g} s"}
    seconds = round(time.time() - started, 1)
    if result.returncode == 0 and result.stdout.strip():
        return {"task": task, "ok": True, "seconds": seconds, **json.loads(result.stdout.strip().splitlines()[-1])}
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    return {"task": task, "ok": False, "seconds": seconds, "error": lines[-1][:300] if lines else f"exit {result.returncode}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS))
    parser.add_argument("--length", type=int, default=1024, help="max_seq_lengths for the build")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for task in args.tasks:
        rows.append(check(task, args.length, args.timeout))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"length": args.length, "command": "python " + " ".join(sys.argv), "tasks": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
