"""The results store: the same text named by another path form is the same run (one file, its cells kept)."""

import json
import os

import pytest

from hf_posext.evaluation.store import ResultStore, equivalent_run_configs


def test_a_relative_and_an_absolute_path_to_the_same_text_share_one_results_file(tmp_path, monkeypatch):
    # The needle haystack named ../books/emma.txt in one session and /abs/books/emma.txt in the next is the
    # same run: the second finds the first's file and computes nothing (before, it started a second file).
    from hf_posext.evaluation import needle
    from hf_posext.evaluation.arguments import parse_methods
    from hf_posext.evaluation.loading import AsciiTokenizer
    from hf_posext.models import tiny_model

    book = tmp_path / "books" / "emma.txt"
    book.parent.mkdir()
    book.write_text(" ".join(f"Sentence number {i} of the book is here." for i in range(80)))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    scored = []
    real = needle.score_retrieval_grouped

    def counting(model, tokenizer, batch, **kwargs):
        scored.extend(batch)
        return real(model, tokenizer, batch, **kwargs)

    monkeypatch.setattr(needle, "score_retrieval_grouped", counting)
    model = tiny_model("llama", seed=0, max_position_embeddings=256)
    common = dict(methods=parse_methods("none"), lengths=[400], depths=[0.5], trials=1, out_dir=tmp_path / "results",
                  model_name="tiny", progress=False, generate=False)
    first = needle.evaluate_needle(model, AsciiTokenizer(), haystack="../books/emma.txt", **common)
    assert len(scored) == 1
    again = needle.evaluate_needle(model, AsciiTokenizer(), haystack=str(book), **common)
    assert len(scored) == 1 and again.path == first.path
    assert again.data["config"]["haystack"] == "../books/emma.txt"  # the file keeps the form it was written with
    assert len(list((tmp_path / "results").glob("needle-*.json"))) == 1


def test_other_text_or_settings_are_other_runs(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.txt").write_text("b")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "results"
    first = ResultStore(out, "perplexity", {"model": "m", "data": "a.txt", "seed": 0})
    assert ResultStore(out, "perplexity", {"model": "m", "data": "b.txt", "seed": 0}).path != first.path
    assert ResultStore(out, "perplexity", {"model": "m", "data": os.path.abspath("a.txt"), "seed": 1}).path != first.path
    assert {"model": "m", "data": os.path.abspath("a.txt"), "seed": 0} in equivalent_run_configs(
        {"model": "m", "data": "a.txt", "seed": 0})
    # a built-in source or a hub dataset name is not a local path: nothing to rewrite
    assert equivalent_run_configs({"model": "m", "data": "builtin:python-docs"}) == []
    assert equivalent_run_configs({"model": "a.txt", "data": "missing.txt"}) == []


def test_a_save_writes_through_a_temporary_file_of_its_own(tmp_path):
    # two writers of one file shared one temporary name: the second's rename found it gone ("[Errno 2] ... .json.tmp
    # -> .json") and stopped; a temporary of its own per save cannot be taken by another writer
    store = ResultStore(tmp_path, "passkey", {"model": "tiny"})
    store.path.with_suffix(".json.tmp").mkdir(parents=True)  # the shared name, taken
    store.put("a", {"length": 64})
    assert '"a": {' in store.path.read_text()
    store.close()  # its writer lock file goes with it
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == sorted([store.path.name, store.path.with_suffix(".csv").name])


def _other_process_writing(out, task: str, run_config: dict) -> "subprocess.Popen":
    """Another process whose store writes ``task``'s results file in ``out`` (held until killed)."""
    import subprocess
    import sys

    script = ("import json, sys, time\nfrom hf_posext.evaluation.store import ResultStore\n"
              "store = ResultStore(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))\n"
              "store.put('theirs', {'method': 'none', 'factor': 1.0, 'length': 64})\nprint('writing', flush=True)\ntime.sleep(600)\n")
    process = subprocess.Popen([sys.executable, "-c", script, str(out), task, json.dumps(run_config)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "writing"
    return process


def test_a_second_writer_of_one_results_file_is_refused_before_it_starts(tmp_path):
    """Two writers of one results file would each keep the cells they read at their start: the second (another
    process, or another store in this one) is refused, naming the file and the holder; a reader is not."""
    from hf_posext.core.locks import FolderBusyError

    config = {"model": "tiny", "seed": 0}
    process = _other_process_writing(tmp_path, "demo", config)
    try:
        with pytest.raises(FolderBusyError, match=rf"demo-tiny-\w+\.json is being written by another run \(pid "
                                                  rf"{process.pid} on .*\); two writers of one results file") as error:
            ResultStore(tmp_path, "demo", config)
        assert "\n" not in str(error.value)
        assert ResultStore(tmp_path, "demo", config, write=False).has("theirs")  # reading needs no lock
        assert ResultStore(tmp_path, "demo", {**config, "seed": 1}).path.name.startswith("demo-tiny-")  # another file
    finally:
        process.kill()
        process.wait()
    store = ResultStore(tmp_path, "demo", config)  # a killed writer releases the file
    assert store.has("theirs")
    with pytest.raises(FolderBusyError, match="is being written by another run"):
        ResultStore(tmp_path, "demo", config)  # a second store in the same process
    store.put("mine", {"method": "none", "factor": 1.0, "length": 128})
    store.close()
    again = ResultStore(tmp_path, "demo", config)
    assert again.has("theirs") and again.has("mine")
    again.close()
    store.put("later", {"method": "none", "factor": 1.0, "length": 256})  # a save after close takes the lock again, or is refused
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".lock")] or store._lock is not None
    store.close()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".lock")]  # a closed store leaves no lock file


def test_a_refused_writer_leaves_no_new_folder(tmp_path):
    from hf_posext.core.locks import FolderBusyError

    out = tmp_path / "new"
    first = ResultStore(out, "needle", {"model": "tiny"})
    first.put("a", {"method": "none", "factor": 1.0, "length": 64})
    with pytest.raises(FolderBusyError):
        ResultStore(out, "needle", {"model": "tiny"})
    first.close()
    assert sorted(p.suffix for p in out.iterdir()) == [".csv", ".json"]
