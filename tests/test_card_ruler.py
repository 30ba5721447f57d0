"""The RULER runner (integrations/lm_eval/ruler.py): samples drawn as lm-eval draws them, the forward timer, and the
tasks that need a download."""

from __future__ import annotations

import json

import pytest

from hf_posext.card.samples import SampleCache, tokenizer_hash
from tests.card_helpers import LENGTH, tiny_folder  # noqa: F401 (a fixture)


def test_a_ruler_dataset_draws_only_the_samples_asked_for():
    """lm-eval's RULER datasets call their generator with num_samples=500 (minutes at 32768 tokens); the card
    replaces it in the globals the dataset function calls (its own copy of the module), for that call only,
    and refuses a dataset that calls no known generator instead of silently drawing 500."""
    pytest.importorskip("lm_eval")
    from hf_posext.integrations.lm_eval.ruler import limit_ruler_samples

    drawn = []
    scope = {"sys_kwext": lambda tokenizer=None, num_samples=500: drawn.append(num_samples) or list(range(num_samples))}
    exec("def fwe_download(**kwargs):\n    return sys_kwext(tokenizer=kwargs.get('tokenizer'), num_samples=500)", scope)
    original = scope["sys_kwext"]
    assert limit_ruler_samples(scope["fwe_download"], 3)(tokenizer="t") == [0, 1, 2] and drawn == [3]
    assert scope["sys_kwext"] is original  # restored after the call
    exec("def plain(**kwargs):\n    return []", scope)
    del scope["sys_kwext"]
    with pytest.raises(RuntimeError, match="calls none of lm-eval's RULER generators"):
        limit_ruler_samples(scope["plain"], 3)


def test_ruler_samples_are_the_first_n_of_a_longer_draw(tiny_folder, tmp_path):
    pytest.importorskip("lm_eval")
    pytest.importorskip("wonderwords")
    from transformers import AutoTokenizer

    from hf_posext.integrations.lm_eval.ruler import ruler_docs

    tokenizer = AutoTokenizer.from_pretrained(tiny_folder)
    three, key = ruler_docs("niah_single_1", tiny_folder, tokenizer, LENGTH, 3, 0, SampleCache(tmp_path / "a"))
    five, _ = ruler_docs("niah_single_1", tiny_folder, tokenizer, LENGTH, 5, 0, SampleCache(tmp_path / "b"))
    assert three == five[:3] and len({d["input"] for d in five}) == 5
    other, _ = ruler_docs("niah_single_1", tiny_folder, tokenizer, LENGTH, 3, 1, SampleCache(tmp_path / "c"))
    assert other != three  # the seed matters, so the key must hold it
    assert key["tokenizer"] == tokenizer_hash(tokenizer) and key["length"] == LENGTH


#: Generate one RULER sample set in a fresh interpreter, the first generation of that process (or after another).
_GENERATE_FIRST = """
import json, sys
from transformers import AutoTokenizer
from hf_posext.card.samples import SampleCache
from hf_posext.integrations.lm_eval.ruler import ruler_docs
from hf_posext.integrations.lm_eval.launcher import import_harness
import_harness()
folder, cache, before = sys.argv[1], sys.argv[2], sys.argv[3]
tokenizer = AutoTokenizer.from_pretrained(folder)
if before:
    ruler_docs(before, folder, tokenizer, {length}, 1, 0, SampleCache(cache + "-before"))
docs, _ = ruler_docs("ruler_fwe", folder, tokenizer, {length}, 2, 0, SampleCache(cache))  # draws from `random`
print(json.dumps(docs))
"""


def test_ruler_samples_do_not_depend_on_what_the_process_generated_before(tiny_folder, tmp_path):
    """The first import of lm-eval's RULER generator modules draws from ``random``: seeded before it, a
    process's first sample set differed from every later one (found when extending a cached set of 10 to 20,
    which the cache then refused). Each set is generated in a fresh interpreter, first or after another task."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("wonderwords")
    import subprocess
    import sys

    script = _GENERATE_FIRST.format(length=LENGTH)
    # the two interpreters run side by side (each mostly imports lm-eval and draws on one core)
    started = [subprocess.Popen([sys.executable, "-c", script, tiny_folder, str(tmp_path / f"cache-{before}"), before],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for before in ("", "niah_single_1")]
    runs = []
    for process in started:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-2000:]
        runs.append(json.loads(out.strip().splitlines()[-1]))
    assert runs[0] == runs[1] and len(runs[0]) == 2


def test_the_forward_timer_waits_for_the_device_around_each_forward(monkeypatch):
    """On CUDA a forward returns with its kernels queued: each timed call starts and ends with a synchronization,
    so that a prefill's work is not counted in the first decode step (the H200 card's yarn rows read 0.033 s of
    prefill at 32768 without them). Here the device is a recorded stand-in."""
    import torch

    import hf_posext.integrations.lm_eval.ruler as lm_card

    events: list[str] = []
    monkeypatch.setattr(lm_card, "device_synchronizer", lambda model: lambda: events.append("sync"))
    model = torch.nn.Embedding(10, 2)
    model.register_forward_hook(lambda *args: events.append("forward"))
    timer = lm_card.ForwardTimer(model)
    model(torch.zeros(1, 3, dtype=torch.long))  # a prefill of 3 tokens, then one decode step
    model(torch.zeros(1, 1, dtype=torch.long))
    timer.remove()
    assert events == ["sync", "forward", "sync", "sync", "forward", "sync"]
    assert [tokens for tokens, _ in timer.calls] == [3, 1]


def test_the_synchronizer_waits_for_every_cuda_device_a_model_holds(monkeypatch):
    import torch

    from hf_posext.integrations.lm_eval.ruler import device_synchronizer

    class Spread:
        def parameters(self):
            return iter([type("P", (), {"device": torch.device(name)})() for name in ("cuda:1", "cpu", "cuda:0", "cuda:1")])

    waited: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(str(device)))
    device_synchronizer(Spread())()
    assert waited == ["cuda:0", "cuda:1"]
    device_synchronizer(torch.nn.Linear(2, 2))()  # a CPU model waits for nothing
    assert waited == ["cuda:0", "cuda:1"]


@pytest.fixture
def fresh_downloads():
    """Forget what this process fetched (or failed to) for the download tasks, before and after the test."""
    pytest.importorskip("lm_eval")
    import hf_posext.integrations.lm_eval.ruler as lm_card
    from hf_posext.integrations.lm_eval.launcher import import_harness

    import_harness()
    lm_card.forget_downloads()
    yield lm_card
    lm_card.forget_downloads()


def test_a_download_task_that_cannot_fetch_is_skipped_with_the_reason(fresh_downloads, monkeypatch):
    import requests

    lm_card = fresh_downloads
    # the tests run with HF_HUB_OFFLINE=1 (conftest): datasets refuses the essays at once, from its own check
    reason = lm_card.download_problem("niah_multikey_1")
    assert reason.startswith("needs a download (essay haystack: downloads baber/paul_graham_essays), which failed here (")
    assert "Offline" in reason and reason.endswith("it runs where that can be fetched") and "\n" not in reason
    assert lm_card.download_problem("niah_single_3") == reason.replace("niah_multikey_1", "niah_single_3")  # one source, tried once

    def no_network(*args, **kwargs):
        raise requests.ConnectionError("Failed to resolve 'rajpurkar.github.io'")

    monkeypatch.setattr(requests, "get", no_network)
    assert "ConnectionError: Failed to resolve 'rajpurkar.github.io'" in lm_card.download_problem("ruler_qa_squad")
    # HotpotQA comes from the hub through requests, which would not honour HF_HUB_OFFLINE: not tried at all
    monkeypatch.setattr(requests, "get", lambda *a, **k: pytest.fail("fetched from the hub with HF_HUB_OFFLINE set"))
    assert "(HF_HUB_OFFLINE is set)" in lm_card.download_problem("ruler_qa_hotpot")


def test_the_essay_tasks_also_need_nltks_sentence_data(fresh_downloads, monkeypatch):
    import datasets
    import nltk

    lm_card = fresh_downloads
    monkeypatch.setattr(datasets, "load_dataset", lambda name, *a, **k: {"text": ["An essay. Of two sentences."]})

    def missing(resource, *args, **kwargs):
        raise LookupError(f"Resource {resource} not found")

    monkeypatch.setattr(nltk.data, "find", missing)
    reason = lm_card.download_problem("niah_single_2")
    assert "punkt_tab" in reason and "python -m nltk.downloader punkt_tab" in reason, reason


def test_a_download_task_whose_data_can_be_fetched_runs_on_the_card(fresh_downloads, tiny_folder, tmp_path, monkeypatch):
    """Where SQuAD can be fetched (here: a stand-in for its server), ruler_qa_squad runs like the offline tasks, on
    samples drawn from that copy, fetched once; the essay task that cannot fetch is listed as skipped."""
    import requests

    from hf_posext.cli import main

    paragraphs = [{"context": f"Paragraph {i} says that the city of Town{i} was founded by person{i}. " * 3,
                   "qas": [{"question": f"Who founded Town{i}?", "answers": [{"text": f"person{i}"}], "is_impossible": False}]}
                  for i in range(60)]
    fetched = []

    class Response:
        def raise_for_status(self):
            pass

        def json(self):
            return {"data": [{"paragraphs": paragraphs}]}

    def server(url, *args, **kwargs):
        fetched.append(url)
        if "SQuAD" not in url:
            raise requests.ConnectionError("no network")
        return Response()

    monkeypatch.setattr(requests, "get", server)
    out = tmp_path / "card"
    argv = ["eval", "suite", "--models", f"base={tiny_folder}", "--methods", "none", "--lengths", str(LENGTH),
            "--tasks", "ruler_qa_squad,niah_single_2", "--trials", "2", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    card = json.loads((out / "card.json").read_text())
    assert [(c["task"], c["n"]) for c in card["cells"]] == [("ruler_qa_squad", 2)]
    assert len(fetched) == 1 and "SQuAD" in fetched[0]  # fetched once: the samples were drawn from the copy checked
    (samples,) = (out / "ruler-samples").glob("ruler_qa_squad-*.json")
    assert "was founded by person" in json.loads(samples.read_text())["docs"][0]["input"]
    assert [s["what"] for s in card["skipped"]] == ["niah_single_2"]
    assert "Offline" in card["skipped"][0]["reason"]


def test_importing_the_ruler_generators_drops_nltks_punkt_noise_and_keeps_the_rest(tmp_path):
    """lm-eval's niah generator module tries to download punkt_tab on import and then prints "Downloaded punkt_tab on
    rank 0" whether it could or not (offline: four nltk error lines and that false line in every card log). Run in a
    fresh interpreter, where the module is imported for the first time, with punkt_tab missing and the download
    failing, as offline."""
    pytest.importorskip("lm_eval")
    import subprocess
    import sys

    script = """
import sys
import nltk
def missing(resource, *args, **kwargs):
    raise LookupError(resource)
def failing(info_or_id=None, quiet=False, print_error_to=sys.stderr, **kwargs):
    print("[nltk_data] Error loading", info_or_id, file=print_error_to)
    return False
nltk.data.find, nltk.download = missing, failing
from hf_posext.integrations.lm_eval.launcher import import_harness
import_harness()
from hf_posext.integrations.lm_eval.ruler import import_ruler_generators
import_ruler_generators()
assert "lm_eval.tasks.ruler.prepare_niah" in sys.modules and nltk.download is failing
print("imported")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "imported"
    assert "punkt" not in done.stdout + done.stderr and "[nltk_data]" not in done.stderr, done.stdout + done.stderr
