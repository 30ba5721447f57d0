"""Long-context evaluation: perplexity, passkey and needle-in-a-haystack, methods side by side.

>>> from hf_posext.evaluation import evaluate_perplexity, parse_methods
>>> store = evaluate_perplexity(model, tokenizer, data="books/", methods=parse_methods("none,yarn"),
...                             lengths=[4096, 8192], out_dir="results")

Protocols: docs/evaluation.md. Command line: ``hf-posext eval {perplexity,passkey,needle}`` and
``hf-posext report RESULTS``; ``accelerate launch`` splits the work across processes.
"""

from hf_posext.evaluation.needle import evaluate_needle
from hf_posext.evaluation.passkey import evaluate_passkey
from hf_posext.evaluation.perplexity import chunked_nll, evaluate_perplexity
from hf_posext.evaluation.report import load_results, markdown_tables, write_plots, write_report
from hf_posext.evaluation.arguments import MethodRequest, parse_lengths, parse_methods
from hf_posext.evaluation.loading import AsciiTokenizer, load_model_and_tokenizer
from hf_posext.evaluation.store import ResultStore
from hf_posext.lm.distributed import Distributed

__all__ = [
    "evaluate_perplexity",
    "evaluate_passkey",
    "evaluate_needle",
    "chunked_nll",
    "load_results",
    "markdown_tables",
    "write_plots",
    "write_report",
    "AsciiTokenizer",
    "Distributed",
    "MethodRequest",
    "ResultStore",
    "load_model_and_tokenizer",
    "parse_lengths",
    "parse_methods",
]
