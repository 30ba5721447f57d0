"""Regenerate the tiny training assets shipped with the tests (deterministic; run from the repo root).

    python tests/data/training/make_tiny_assets.py

Writes ``tests/data/training/corpus/*.txt`` (synthetic ledger sentences: made up here, no third-party
text) and ``tests/data/training/tiny-llama/`` (a tiny random Llama, window 64, with a 128-token
character-level BPE tokenizer trained on that corpus). The tiny recipe and the training tests use them.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLOURS = ["red", "blue", "green", "grey", "white", "black", "amber", "violet"]
ANIMALS = ["fox", "heron", "otter", "badger", "lynx", "crane", "beaver", "hare"]
ITEMS = ["stones", "reeds", "shells", "seeds", "twigs", "feathers", "acorns", "pebbles"]
PLACES = ["river", "hill", "marsh", "forest", "meadow", "shore", "valley", "ridge"]


def make_corpus(folder: Path, documents: int = 6, lines: int = 120, seed: int = 0) -> None:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for number in range(documents):
        text = []
        for line in range(lines):
            colour, animal, item, place = rng.choice(COLOURS), rng.choice(ANIMALS), rng.choice(ITEMS), rng.choice(PLACES)
            count = rng.randint(2, 99)
            text.append(f"Entry {line}: the {colour} {animal} carried {count} {item} to the {place}.")
        (folder / f"ledger_{number}.txt").write_text("\n".join(text) + "\n")


def make_model(folder: Path, corpus: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hf_posext.models import tiny_model

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=128, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tokenizer.train([str(p) for p in sorted(corpus.glob("*.txt"))], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    model = tiny_model("llama", seed=0, vocab_size=128, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)


if __name__ == "__main__":
    make_corpus(HERE / "corpus")
    make_model(HERE / "tiny-llama", HERE / "corpus")
    print(f"wrote {HERE / 'corpus'} and {HERE / 'tiny-llama'}")
