"""llama.cpp round trip with no C++ build: export each method's tiny model, convert it to GGUF, read the rope metadata back.

Uses llama.cpp's own Python converter (``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py``) as vendored in the
llama-cpp-python sdist, plus ``sentencepiece`` (a converter requirement: the ``serve`` extra, which scripts/setup.sh
installs; without it the script installs it into the cache directory).

    python bench/llama_cpp_roundtrip.py [--sdist llama_cpp_python-0.3.36.tar.gz] [--json bench/results/llama_cpp_roundtrip/llama_cpp_roundtrip.json]

Without ``--sdist`` it runs ``pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`` into the cache.
It asserts the metadata against tests/data/serving/llama_cpp_expected.json (``--write-expected`` rewrites it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXPECTED = REPO / "tests" / "data" / "serving" / "llama_cpp_expected.json"
VERSION = "0.3.36"
CACHE = Path.home() / ".cache" / "hf_posext" / "llama_cpp"
METHODS = {"none": {}, "linear": {}, "ntk": {}, "theta": {"base": 50000.0}, "yarn": {}, "llama3": {}}
FACTOR = 4.0
ROPE_KEYS = ("context_length", "rope.freq_base", "rope.scaling.type", "rope.scaling.factor",
             "rope.scaling.original_context_length", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
             "rope.scaling.yarn_attn_factor")


def fetch_sdist(cache: Path) -> Path:
    """The llama-cpp-python sdist, downloaded with pip into ``cache`` unless already there."""
    found = sorted(cache.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if found:
        return found[0]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest", str(cache),
                    f"llama-cpp-python=={VERSION}"], check=True)
    return next(cache.glob(f"llama_cpp_python-{VERSION}.tar.gz"))


def extract_converter(sdist: Path, cache: Path) -> Path:
    """Extract only vendor/llama.cpp's converter, conversion package and gguf-py; return the llama.cpp folder."""
    root = cache / sdist.name.removesuffix(".tar.gz")
    wanted = ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/", "vendor/llama.cpp/gguf-py/")
    if not (root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").exists():
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if any(w in m.name for w in wanted)]
            archive.extractall(cache, members=members, filter="data")
    return root / "vendor" / "llama.cpp"


def install_sentencepiece(cache: Path) -> Path:
    """A folder for PYTHONPATH from which the converter imports sentencepiece (for Llama vocabularies).

    Empty when sentencepiece is installed (``pip install -e ".[serve]"``, as scripts/setup.sh does); otherwise
    it is installed there with ``pip install --target``.
    """
    target = cache / "deps"
    target.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("sentencepiece") is None and not (target / "sentencepiece").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target),
                        "sentencepiece>=0.1.98,<0.3.0"], check=True)
    return target


def tiny_sentencepiece(folder: Path, vocab_size: int, deps: Path, byte_fallback: bool = False) -> None:
    """Train a throwaway SentencePiece model of ``vocab_size`` pieces as ``folder/tokenizer.model``.

    ``byte_fallback`` adds the 256 byte pieces: llama.cpp's vocabulary loader looks up ``<0x0A>`` when it
    loads a model (bench/llama_cpp_scoring.py needs them; reading metadata back does not).
    """
    sys.path.insert(0, str(deps))
    import sentencepiece as spm

    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(f"the quick brown fox jumps over the lazy dog {i}" for i in range(300)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=vocab_size,
                                   model_type="bpe", byte_fallback=byte_fallback, hard_vocab_limit=False, minloglevel=2)
    corpus.unlink()
    (folder / "tokenizer.vocab").unlink()


def exported_tiny_model(method: str, work: Path, deps: Path) -> Path:
    """Patch a tiny Llama with ``method``, save it, add a tokenizer and export it for llama.cpp."""
    import hf_posext
    from hf_posext.export import export
    from hf_posext.models import tiny_model

    model = tiny_model("llama", initializer_range=0.1)
    if method != "none":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf_posext.patch(model, method, FACTOR, **METHODS[method])
    saved = work / f"{method}-saved"
    model.save_pretrained(saved)
    tiny_sentencepiece(saved, model.config.vocab_size, deps)
    return export(saved, "llama.cpp", work / f"{method}-llama.cpp")


def convert(llama_cpp: Path, folder: Path, deps: Path) -> Path:
    """Run llama.cpp's converter on ``folder``; return the GGUF path."""
    out = folder.with_suffix(".gguf")
    env_path = f"{llama_cpp / 'gguf-py'}:{deps}"
    subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(out),
                    "--outtype", "f32"], check=True, capture_output=True, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    return out


def rope_metadata(llama_cpp: Path, gguf_path: Path) -> dict:
    """The rope fields of a GGUF file (architecture prefix dropped) and its rope_freqs tensor, if any."""
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    arch = reader.fields["general.architecture"].contents()
    result = {}
    for key in ROPE_KEYS:
        field = reader.fields.get(f"{arch}.{key}")
        if field is not None:
            value = field.contents()
            result[key] = round(value, 6) if isinstance(value, float) else value
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            result["rope_freqs"] = [round(float(v), 6) for v in tensor.data]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, help="a local llama-cpp-python sdist (default: pip download it)")
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--json", type=Path, help="write the measured metadata and timings here")
    parser.add_argument("--write-expected", action="store_true", help="rewrite the checked-in expectation table")
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    sdist = args.sdist or fetch_sdist(args.cache)
    llama_cpp = extract_converter(sdist, args.cache)
    deps = install_sentencepiece(args.cache)
    setup_s = time.perf_counter() - start
    measured = {}
    with tempfile.TemporaryDirectory() as work:
        for method in METHODS:
            folder = exported_tiny_model(method, Path(work), deps)
            measured[method] = rope_metadata(llama_cpp, convert(llama_cpp, folder, deps))
    total_s = time.perf_counter() - start
    if args.write_expected:
        EXPECTED.parent.mkdir(parents=True, exist_ok=True)
        EXPECTED.write_text(json.dumps(measured, indent=2, sort_keys=True) + "\n")
    expected = json.loads(EXPECTED.read_text())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"llama_cpp_python": VERSION, "setup_s": round(setup_s, 1),
                                         "total_s": round(total_s, 1), "metadata": measured}, indent=2) + "\n")
    mismatched = [m for m in METHODS if measured[m] != expected.get(m)]
    print(f"setup {setup_s:.1f} s, total {total_s:.1f} s; mismatched: {mismatched or 'none'}")
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
