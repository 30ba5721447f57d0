"""Two processes (accelerate launch, gloo on CPU) give the same numbers as one."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = '''
import sys
from hf_posext.evaluation import evaluate_passkey, evaluate_perplexity, parse_methods
from hf_posext.evaluation.loading import load_model_and_tokenizer
from hf_posext.lm.distributed import Distributed

text, out = sys.argv[1], sys.argv[2]
dist = Distributed()
model, tokenizer = load_model_and_tokenizer("tiny:llama:256")
evaluate_perplexity(model, tokenizer, data=text, methods=parse_methods("none,yarn"), factor=2.0, lengths=[32, 300],
                    max_segments=3, out_dir=out, model_name="tiny", dist=dist)
evaluate_passkey(model, tokenizer, methods=parse_methods("none,dynamic-yarn"), lengths=[350], depths=[0.0, 1.0], trials=2,
                 max_new_tokens=4, out_dir=out, model_name="tiny", dist=dist)
'''


def _cells(folder: Path, task: str) -> dict:
    (file,) = folder.glob(f"{task}-*.json")
    return json.loads(file.read_text())


def _launch(driver: Path, args: list[str], processes: int) -> None:
    if processes == 1:
        command = [sys.executable, str(driver)]
    else:
        launcher = shutil.which("accelerate")
        if launcher is None:
            pytest.skip("the accelerate launcher is not installed")
        command = [launcher, "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
                   "--mixed_precision", "no", "--dynamo_backend", "no", str(driver)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command + args, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.multiprocess
def test_two_processes_give_the_numbers_of_one(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    text = tmp_path / "text.txt"
    text.write_text("A sentence of ordinary words for the test. " * 60)
    for processes in (1, 2):
        _launch(driver, [str(text), str(tmp_path / f"p{processes}")], processes)
    for task, metrics in (("perplexity", ("nll", "tokens", "windows")), ("passkey", ("teacher_forced_accuracy", "greedy_accuracy"))):
        one, two = _cells(tmp_path / "p1", task), _cells(tmp_path / "p2", task)
        assert two["runs"][-1]["world_size"] == 2 and one["runs"][-1]["world_size"] == 1
        assert one["cells"].keys() == two["cells"].keys() and len(one["cells"]) == 4
        for key, record in one["cells"].items():
            other = two["cells"][key]
            for metric in metrics:
                assert record[metric] == other[metric], (task, key, metric)
            strip = lambda units: [{k: v for k, v in u.items() if k != "seconds"} for u in units]  # noqa: E731
            assert strip(record["units"]) == strip(other["units"])
