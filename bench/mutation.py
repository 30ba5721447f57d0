"""Mutation testing of the modules where a silent bug costs most.

Mutants come from cosmic-ray's operators (``pip install cosmic-ray==8.7.0``; parso-based, so every
function is mutated, decorated ones included: the RoPE methods are registered by a decorator, which
mutmut 3 skips). Each mutant is written into a private copy of the tree and tested by a child forked
from a process that has already imported torch, transformers and pytest, so a mutant costs its tests,
not an interpreter start. Only the tests that execute the mutated line run (a clean run under
coverage, per test, over the module's test files in ``GROUPS`` below), fastest first, stopping at the
first failure.

A bench script, never CI: it takes hours on 2 shared cores. Results are kept per mutant in
``bench/results/mutation/mutation.json`` (written after every mutant) and a run skips the mutants already
there, so it can be stopped and resumed at will. ``bench/results/mutation/mutation_survivors.md`` lists the
kill rate per module and every surviving mutant. Mutants judged equivalent (no input can tell them
from the original) are listed with the reason in ``bench/mutation_equivalent.json``.

Set up once (a separate venv, so the shared environment's packages stay as they are)::

    python -m venv --system-site-packages ~/.cache/hf-posext-mutation-venv
    ~/.cache/hf-posext-mutation-venv/bin/pip install cosmic-ray==8.7.0 coverage

Run (it re-executes itself with that venv's python; ``--group`` repeats; no group = all, in order)::

    nice -n 10 python bench/mutation.py --group retrieval --group chunked_loss
    nice -n 10 python bench/mutation.py --rerun-survivors --group retrieval   # after adding a test
    python bench/mutation.py --report      # rewrite the survivors list from the JSON only

The boundary pass (``--boundary``, its own groups ``BOUNDARY_GROUPS`` and results
``bench/results/mutation/mutation_boundary.json`` / ``mutation_boundary_survivors.md``) mutates where an
off-by-one or a stale cache hides: ``<`` <-> ``<=`` and ``>`` <-> ``>=`` (cosmic-ray's), the right-hand side of
every comparison that involves a length, size, window, offset or position moved by +1 and by -1
(``boundary/AddOneToBound``, ``boundary/SubtractOneFromBound``), and every cache key with one field dropped
(``boundary/DropCacheKeyField``: a tuple assigned to a ``*key`` name or passed as a decode-step table key, and
each conjunct of a cache-hit check on ``held`` / ``cached`` values). Each group runs only its own few test files::

    nice -n 10 python bench/mutation.py --boundary --sample 40       # at most 40 mutants per module
    python bench/mutation.py --boundary --report
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "mutation" / "mutation.json"
SURVIVORS = ROOT / "bench" / "results" / "mutation" / "mutation_survivors.md"
BOUNDARY_RESULTS = ROOT / "bench" / "results" / "mutation" / "mutation_boundary.json"
BOUNDARY_SURVIVORS = ROOT / "bench" / "results" / "mutation" / "mutation_boundary_survivors.md"
EQUIVALENT = ROOT / "bench" / "mutation_equivalent.json"
DEFAULT_VENV = Path.home() / ".cache" / "hf-posext-mutation-venv"
DEFAULT_WORK = Path(os.environ.get("TMPDIR", "/tmp")) / "hf-posext-mutation"


@dataclasses.dataclass(frozen=True)
class Group:
    """Modules mutated together and the test files that cover them.

    Attributes:
        sources: Module paths relative to the repository root.
        tests: Test files run against their mutants (only the tests that execute a mutated line).
        functions: Per module, when given: only mutants inside these functions or classes
            (cosmic-ray's enclosing definition name); the others are out of scope.
        skip: Per module, functions left out, each with the reason (code no CPU test can run).
        operators: The operators applied (None: ``OPERATORS``; the boundary groups: ``BOUNDARY_OPERATORS``).
    """

    sources: tuple[str, ...]
    tests: tuple[str, ...]
    functions: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    skip: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    operators: tuple[str, ...] | None = None
    unsampled: tuple[str, ...] = ()  # operators whose mutants ``--sample`` keeps all of (cache keys, where they are few)


# Order = priority: where a surviving mutant is likeliest to be a real bug. Modules tested by the same
# files share a group, so that one clean run under coverage serves them all.
_DCA_POSITIONS = ("_LayerSettings", "_query_offsets", "_query_offsets_by_distance", "_rotate_keys", "_rotate",
                  "_decode_tables", "dual_chunk_explicit", "index")
_SELF_EXTEND_POSITIONS = ("_LayerSettings", "_grouped_table", "_to_grouped", "_count_at_most", "_min_count_at_most",
                          "_grouped_keys", "rotated", "_decode_tables")
GROUPS: dict[str, Group] = {
    "retrieval": Group(
        ("hf_posext/evaluation/retrieval.py",),
        ("tests/test_evaluation_passkey.py", "tests/test_evaluation_needle.py", "tests/test_mutation_kills_retrieval.py"),
    ),
    "chunked_loss": Group(
        ("hf_posext/lm/chunked_loss.py",),
        ("tests/test_lm_chunked_loss.py", "tests/test_mutation_kills_chunked_loss.py"),
    ),
    "methods_rope": Group(
        ("hf_posext/methods/rope.py", "hf_posext/methods/transformers.py", "hf_posext/methods/registry.py"),
        ("tests/test_methods_parity.py", "tests/test_patching.py", "tests/test_api.py", "tests/test_relative.py",
         "tests/test_mutation_kills_methods.py"),
    ),
    "attention": Group(
        ("hf_posext/backends/attention/kernels.py", "hf_posext/methods/attention.py", "hf_posext/methods/dual_chunk.py",
         "hf_posext/backends/attention/dual_chunk.py", "hf_posext/backends/attention/self_extend.py"),
        ("tests/test_self_extend.py", "tests/test_dca.py", "tests/test_dca_shapes.py", "tests/test_dca_scale.py",
         "tests/test_attention_margins.py", "tests/test_mutation_kills_attention.py", "tests/test_mutation_kills_methods.py"),
        functions={"hf_posext/backends/attention/dual_chunk.py": _DCA_POSITIONS,
                   "hf_posext/backends/attention/self_extend.py": _SELF_EXTEND_POSITIONS},
        skip={"hf_posext/backends/attention/kernels.py": {
            "cuda_attention_with_lse": "CUDA only: checked on a GPU by bench/gpu_checks.py, never on CPU"}},
    ),
    "string": Group(
        ("hf_posext/methods/shifted_positions.py",),
        ("tests/test_string.py", "tests/test_mutation_kills_methods.py"),
    ),
    "request": Group(
        ("hf_posext/core/request.py",),
        ("tests/test_api.py", "tests/test_bad_input.py", "tests/test_mutation_kills_request.py"),
    ),
    "learned_relative": Group(
        ("hf_posext/methods/learned.py", "hf_posext/methods/relative.py", "hf_posext/backends/relative.py"),
        ("tests/test_absolute.py", "tests/test_relative.py", "tests/test_relative_scaling.py",
         "tests/test_mutation_kills_learned_relative.py"),
    ),
    "fingerprints": Group(
        ("hf_posext/evaluation/fingerprints.py",),
        ("tests/test_evaluation_fingerprints.py", "tests/test_evaluation_perplexity.py",
         "tests/test_mutation_kills_fingerprints.py"),
    ),
    "checkpoints": Group(
        ("hf_posext/training/checkpoints.py",),
        ("tests/test_training_trainer.py", "tests/test_training_checkpoints.py"),
    ),
}

# Realistic small bugs, not all of cosmic-ray's cross product (x * y -> x << y is caught by any type
# check and costs a test run): a swapped or off-by-one comparison, a sign or inverse operator, a
# constant off by one, a flipped boolean or condition, a loop that never runs.
OPERATORS = (
    "core/NumberReplacer",
    "core/ReplaceTrueWithFalse",
    "core/ReplaceFalseWithTrue",
    "core/ReplaceAndWithOr",
    "core/ReplaceOrWithAnd",
    "core/AddNot",
    "core/ZeroIterationForLoop",
    "core/ReplaceBreakWithContinue",
    "core/ReplaceContinueWithBreak",
    "core/ReplaceUnaryOperator_USub_UAdd",
    "core/ReplaceUnaryOperator_Delete_USub",
    "core/ReplaceUnaryOperator_Delete_Not",
    "core/ReplaceBinaryOperator_Add_Sub",
    "core/ReplaceBinaryOperator_Sub_Add",
    "core/ReplaceBinaryOperator_Mul_Div",
    "core/ReplaceBinaryOperator_Div_Mul",
    "core/ReplaceBinaryOperator_Div_FloorDiv",
    "core/ReplaceBinaryOperator_FloorDiv_Div",
    "core/ReplaceBinaryOperator_Pow_Mul",
    "core/ReplaceBinaryOperator_Mod_FloorDiv",
    "core/ReplaceComparisonOperator_Lt_LtE",
    "core/ReplaceComparisonOperator_LtE_Lt",
    "core/ReplaceComparisonOperator_Gt_GtE",
    "core/ReplaceComparisonOperator_GtE_Gt",
    "core/ReplaceComparisonOperator_Lt_Gt",
    "core/ReplaceComparisonOperator_Gt_Lt",
    "core/ReplaceComparisonOperator_Eq_NotEq",
    "core/ReplaceComparisonOperator_NotEq_Eq",
    "core/ReplaceComparisonOperator_Is_IsNot",
    "core/ReplaceComparisonOperator_IsNot_Is",
)

# The boundary pass: comparison boundaries and cache keys, each group against its own few
# test files (the boundary tests first), so that a mutant costs seconds.
BOUNDARY_OPERATORS = (
    "core/ReplaceComparisonOperator_Lt_LtE",
    "core/ReplaceComparisonOperator_LtE_Lt",
    "core/ReplaceComparisonOperator_Gt_GtE",
    "core/ReplaceComparisonOperator_GtE_Gt",
    "boundary/AddOneToBound",
    "boundary/SubtractOneFromBound",
    "boundary/DropCacheKeyField",
)
_ATTENTION_TESTS = ("tests/test_attention_boundaries.py", "tests/test_attention_caches.py")
BOUNDARY_GROUPS: dict[str, Group] = {
    "boundary_attention": Group(
        ("hf_posext/backends/attention/shifted_positions.py", "hf_posext/backends/attention/dual_chunk.py",
         "hf_posext/backends/attention/self_extend.py", "hf_posext/backends/attention/kernels.py",
         "hf_posext/methods/dual_chunk.py", "hf_posext/backends/rope/module.py"),
        _ATTENTION_TESTS,
        functions={
            "hf_posext/backends/attention/shifted_positions.py": ("shift_factors", "string_explicit", "string_split",
                                                                  "index", "string_attention"),
            "hf_posext/backends/attention/dual_chunk.py": ("frequencies", "chunk_step", "_score_scale", "_decode_tables",
                                                           "_cached_decode_tables", "dual_chunk_attention"),
            "hf_posext/backends/attention/self_extend.py": ("_grouped_table", "_to_grouped", "grouped_attention",
                                                            "_decode_tables", "_cached_decode_tables", "self_extend_attention",
                                                            "_grouped_keys"),
            "hf_posext/backends/attention/kernels.py": ("get", "for_call", "call_positions"),
            "hf_posext/methods/dual_chunk.py": ("length_scale",),
            "hf_posext/backends/rope/module.py": ("frequencies",),
        },
        operators=BOUNDARY_OPERATORS, unsampled=("boundary/DropCacheKeyField",),
    ),
    "boundary_retrieval": Group(
        ("hf_posext/evaluation/retrieval.py", "hf_posext/evaluation/passkey.py", "hf_posext/evaluation/needle.py",
         "hf_posext/evaluation/paired.py"),
        ("tests/test_evaluation_retrieval_boundaries.py", "tests/test_mutation_kills_retrieval.py",
         "tests/test_evaluation_passkey.py", "tests/test_evaluation_needle.py", "tests/test_evaluation_paired.py"),
        operators=BOUNDARY_OPERATORS, unsampled=("boundary/DropCacheKeyField",),
    ),
    "boundary_training": Group(
        ("hf_posext/training/checkpoints.py", "hf_posext/training/retrieval_data.py"),
        ("tests/test_training_checkpoint_manifest.py", "tests/test_training_checkpoints.py",
         "tests/test_training_retrieval_wording.py", "tests/test_training_retrieval_data.py"),
        operators=BOUNDARY_OPERATORS, unsampled=("boundary/DropCacheKeyField",),
    ),
    "boundary_fingerprints": Group(
        ("hf_posext/evaluation/fingerprints.py",),
        ("tests/test_evaluation_fingerprints_attention_factor.py", "tests/test_evaluation_fingerprints.py"),
        operators=BOUNDARY_OPERATORS, unsampled=("boundary/DropCacheKeyField",),
    ),
}

PYTEST_ARGS = ["-q", "-x", "-p", "no:cacheprovider", "--no-header", "-m", "not real_model and not multiprocess",
               "-W", "ignore"]
KILLED = ("killed", "timeout", "crashed")


# ------------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------------


def _sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()[:16]


def _write_json_atomic(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def load_results(path: Path = RESULTS, operators: tuple[str, ...] = OPERATORS) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"tool": "cosmic-ray 8.7.0 operators, bench/mutation.py runner", "operators": list(operators),
            "sources": {}, "mutants": {}}


def load_equivalent(results: dict) -> dict:
    """Equivalent mutants whose recorded change still matches the mutant (a stale mark counts for nothing)."""
    marks = json.loads(EQUIVALENT.read_text()) if EQUIVALENT.exists() else {}
    valid = {}
    for key, mark in marks.items():
        entry = results["mutants"].get(key)
        if entry is not None and mark["diff"] not in entry["diff"]:
            print(f"WARNING: {EQUIVALENT.name} marks {key} as {mark['diff']!r}, but that mutant is now "
                  f"{entry['diff']!r}: the mark is ignored; check it.")
            continue
        valid[key] = mark
    return valid


def refresh_tree(work: Path) -> Path:
    """Copy hf_posext/, tests/, recipes/ (the training tests read its configs) and pyproject.toml into
    ``work/tree`` (the tree mutants are written into)."""
    tree = work / "tree"
    for name in ("hf_posext", "tests", "recipes"):
        if (tree / name).exists():
            shutil.rmtree(tree / name)
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


# ------------------------------------------------------------------------------------------------
# Mutants
# ------------------------------------------------------------------------------------------------


def enumerate_mutants(source_path: Path, relative: str, functions: tuple[str, ...] | None,
                      skip: dict[str, str] | None = None, operators: tuple[str, ...] | None = None) -> list[dict]:
    """Every mutant of one module, as cosmic-ray's ``init`` enumerates them (operator, occurrence); the
    ``boundary/`` operators are this file's own (:func:`boundary_positions`)."""
    import cosmic_ray.plugins
    from cosmic_ray.ast import ast_nodes, get_ast_from_path
    from cosmic_ray.ast.ast_query import ASTQuery

    module_ast = get_ast_from_path(source_path)
    mutants = []
    for operator_name in operators or OPERATORS:
        if operator_name.startswith("boundary/"):
            for occurrence, position in enumerate(boundary_positions(source_path.read_text(), operator_name)):
                definition = position["function"]
                if functions is not None and definition not in functions or definition in (skip or {}):
                    continue
                mutants.append({"module": relative, "operator": operator_name, "occurrence": occurrence,
                                "line": position["line"], "end_line": position["end_line"], "function": definition})
            continue
        operator = cosmic_ray.plugins.get_operator(operator_name)()
        positions = [(node, start, end) for node in ast_nodes(module_ast) for start, end in operator.mutation_positions(node)]
        for occurrence, (node, start, end) in enumerate(positions):
            definition = ASTQuery(node).get_definition_name()
            if functions is not None and definition not in functions or definition in (skip or {}):
                continue
            mutants.append({"module": relative, "operator": operator_name, "occurrence": occurrence,
                            "line": start[0], "end_line": end[0], "function": definition})
    return mutants


def mutated_source(source: str, operator_name: str, occurrence: int) -> str | None:
    if operator_name.startswith("boundary/"):
        positions = boundary_positions(source, operator_name)
        return positions[occurrence]["apply"]() if occurrence < len(positions) else None
    import cosmic_ray.plugins
    from cosmic_ray.mutating import mutate_code

    return mutate_code(source, cosmic_ray.plugins.get_operator(operator_name)(), occurrence)


# Names that make a comparison a length / offset boundary (a +-1 there is the classic off-by-one).
_BOUND_WORDS = re.compile(r"len|size|window|offset|shift|position|start|end|count|limit|step|chunk|budget|room|groups|"
                          r"trials|tokens|index|low|high|depth|distance|kv_|q_|rows|block|done|diagonal|near|edge|"
                          r"global_step|local", re.IGNORECASE)
# Values a cache hit is checked against.
_CACHE_CHECK_WORDS = re.compile(r"\bheld\b|\bcached\b")


def _byte_offsets(source: str) -> list[int]:
    """Byte offset of the start of each line (ast columns count UTF-8 bytes)."""
    offsets, total = [0], 0
    for line in source.splitlines(keepends=True):
        total += len(line.encode())
        offsets.append(total)
    return offsets


def _span(node, lines: list[int]) -> tuple[int, int]:
    return lines[node.lineno - 1] + node.col_offset, lines[node.end_lineno - 1] + node.end_col_offset


def _enclosing_definitions(tree) -> dict:
    """node -> name of the innermost function or class around it (``None`` at module level)."""
    import ast

    names: dict = {}

    def visit(node, name):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else name
            names[child] = inner
            visit(child, inner)

    visit(tree, None)
    return names


def boundary_positions(source: str, operator_name: str) -> list[dict]:
    """The places ``operator_name`` (a ``boundary/`` operator) mutates in ``source``, in source order: each a dict
    with ``line``, ``end_line``, ``function`` and ``apply()`` (the mutated source)."""
    import ast

    tree = ast.parse(source)
    lines = _byte_offsets(source)
    encoded = source.encode()
    definitions = _enclosing_definitions(tree)
    text = lambda node: ast.get_source_segment(source, node) or ""  # noqa: E731

    def replacing(start: int, end: int, new: str):
        return lambda: (encoded[:start] + new.encode() + encoded[end:]).decode()

    found = []
    for node in ast.walk(tree):
        if operator_name in ("boundary/AddOneToBound", "boundary/SubtractOneFromBound"):
            if not (isinstance(node, ast.Compare) and len(node.ops) == 1
                    and isinstance(node.ops[0], (ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Eq, ast.NotEq))):
                continue
            right = node.comparators[0]
            sides = (node.left, right)
            if any(isinstance(side, ast.Constant) and not isinstance(side.value, (int, float)) or
                   isinstance(side, ast.Constant) and isinstance(side.value, bool) for side in sides):
                continue  # strings, None, booleans: no boundary
            if not any(_BOUND_WORDS.search(text(side)) for side in sides):
                continue
            start, end = _span(right, lines)
            sign = "+" if operator_name.endswith("AddOneToBound") else "-"
            found.append((node, right, replacing(start, end, f"({text(right)} {sign} 1)")))
        elif operator_name == "boundary/DropCacheKeyField":
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Tuple):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if not any(isinstance(t, ast.Name) and "key" in t.id.lower() and not t.id.isupper() for t in targets):
                    continue
                fields, container = node.value.elts, node.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "for_call"):
                tuples = [a for a in node.args if isinstance(a, ast.Tuple)]
                if not tuples:
                    continue
                container = tuples[0]
                fields = container.elts
            elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And) and _CACHE_CHECK_WORDS.search(text(node)):
                fields, container = node.values, node
            else:
                continue
            if len(fields) < 2:
                continue
            start, end = _span(container, lines)
            for dropped in range(len(fields)):
                kept = [text(f) for i, f in enumerate(fields) if i != dropped]
                if isinstance(container, ast.BoolOp):
                    new = "(" + " and ".join(kept) + ")"
                else:
                    new = "(" + ", ".join(kept) + ("," if len(kept) == 1 else "") + ")"
                found.append((node, fields[dropped], replacing(start, end, new)))
        else:
            raise ValueError(f"unknown boundary operator {operator_name!r}")
    found.sort(key=lambda item: (item[1].lineno, item[1].col_offset))
    return [{"line": field.lineno, "end_line": field.end_lineno, "function": definitions.get(node), "apply": apply}
            for node, field, apply in found]


def short_diff(before: str, after: str) -> str:
    lines = [line for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
             if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    return "\n".join(line[0] + " " + line[1:].strip() for line in lines)


def mutant_key(m: dict) -> str:
    return f"{m['module']}:{m['operator'].split('/')[-1]}:{m['occurrence']}"


# ------------------------------------------------------------------------------------------------
# Running tests in forked children
# ------------------------------------------------------------------------------------------------


def _preload() -> None:
    # Import the heavy dependencies once, in the parent; never hf_posext (children import the mutated copy).
    sys.dont_write_bytecode = True
    import pytest  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    for name in ("llama", "gpt2", "t5", "gpt_neox", "opt", "mistral", "qwen2"):
        try:
            __import__(f"transformers.models.{name}.modeling_{name}")
        except ImportError:
            pass
    try:
        import accelerate  # noqa: F401
        import peft  # noqa: F401
    except ImportError:
        pass


def _in_child(tree: Path, function, timeout: float, result_path: Path):
    """Run ``function(result_path)`` in a forked child; returns ``(exit code or None on timeout, seconds)``."""
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        code = 3
        try:
            os.setpgid(0, 0)
            os.chdir(tree)
            sys.path.insert(0, str(tree))
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            code = int(function(result_path))
        except BaseException:  # noqa: BLE001 - any failure of the child is reported by its exit code
            code = 3
        finally:
            os._exit(code)
    deadline = start + timeout
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status), time.monotonic() - start
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:  # a timeout, or this process interrupted: the child and anything it started go too
        try:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    return None, time.monotonic() - start


def _coverage_run(sources: list[str], tests: list[str]):
    def run(result_path: Path) -> int:
        import coverage
        import pytest

        cov = coverage.Coverage(data_file=None, include=[str(Path.cwd() / s) for s in sources], branch=False)
        durations: dict[str, float] = {}
        outcomes: dict[str, str] = {}

        class Contexts:
            @pytest.hookimpl(hookwrapper=True)
            def pytest_runtest_protocol(self, item, nextitem):
                cov.switch_context(item.nodeid)
                start = time.monotonic()
                yield
                durations[item.nodeid] = time.monotonic() - start
                cov.switch_context("")

            def pytest_runtest_logreport(self, report):
                if report.failed:
                    outcomes[report.nodeid] = "failed"

        cov.start()
        code = pytest.main([a for a in PYTEST_ARGS if a != "-x"] + tests, plugins=[Contexts()])
        cov.stop()
        data = cov.get_data()
        lines: dict[str, dict[str, list[str]]] = {}
        for source in sources:
            by_line = data.contexts_by_lineno(str(Path.cwd() / source))
            # "" is the context outside any test: module-level lines run at import (collection) time.
            lines[source] = {str(line): sorted(contexts) for line, contexts in by_line.items()}
        result_path.write_text(json.dumps({"exit": int(code), "durations": durations, "failed": sorted(outcomes),
                                           "lines": lines}))
        return 0

    return run


def _test_run(nodeids: list[str]):
    def run(result_path: Path) -> int:
        import pytest

        failed: list[str] = []

        class Record:
            def pytest_runtest_logreport(self, report):
                if report.failed:
                    failed.append(report.nodeid)

        code = int(pytest.main(PYTEST_ARGS + nodeids, plugins=[Record()]))
        result_path.write_text(json.dumps({"exit": code, "failed": failed}))
        return code

    return run


def coverage_map(name: str, group: Group, tree: Path, work: Path) -> dict:
    """Which tests execute which line of the group's modules (cached by the sources' and tests' hashes)."""
    tests = [t for t in group.tests if (tree / t).exists()]
    fingerprint = _sha("".join((tree / p).read_text() for p in (*group.sources, *tests)))
    cache = work / f"coverage_{name}.json"
    if cache.exists():
        cached = json.loads(cache.read_text())
        if cached.get("fingerprint") == fingerprint and not cached.get("failed"):  # failures: rerun (the tree may be fixed)
            return cached
    print(f"[{name}] clean run under coverage: {' '.join(tests)}", flush=True)
    out = work / "child.json"
    exit_code, seconds = _in_child(tree, _coverage_run(list(group.sources), tests), 7200, out)
    if exit_code is None or not out.exists():
        raise SystemExit(f"[{name}] the clean run did not finish (exit {exit_code}); run the tests by hand.")
    result = json.loads(out.read_text())
    if result["failed"]:
        print(f"[{name}] WARNING: {len(result['failed'])} tests fail on the clean tree and are left out: "
              f"{result['failed'][:5]}", flush=True)
    for source in result["lines"].values():
        for line, contexts in source.items():
            source[line] = [c for c in contexts if c not in result["failed"]]
    result["fingerprint"] = fingerprint
    result["seconds"] = seconds
    print(f"[{name}] clean run: {seconds:.0f} s, {len(result['durations'])} tests", flush=True)
    _write_json_atomic(cache, result)
    return result


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------


def tests_for_lines(cover: dict, module: str, first: int, last: int) -> list[str]:
    """Tests that execute lines first..last, fastest first; every test of the module for import-time lines."""
    by_line = cover["lines"][module]
    tests = {t for line in range(first, last + 1) for t in by_line.get(str(line), [])}
    if "" in tests:  # run at import: any test of the module may depend on it
        tests = {t for contexts in by_line.values() for t in contexts}
    tests.discard("")
    return sorted(tests, key=lambda t: cover["durations"].get(t, 0.0))


def statement_lines(source: str, line: int) -> tuple[int, int]:
    """The lines of the innermost statement holding ``line``; for a ``def`` or ``class`` only its header.

    Coverage records a statement under its first line only, so a mutant on a continuation line (a
    keyword-only ``*`` in a long signature, the second line of a condition) would find no test; its
    statement's lines do.
    """
    import ast

    best = (line, line)
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.stmt) or not node.lineno <= line <= (node.end_lineno or node.lineno):
            continue
        end = node.end_lineno or node.lineno
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            end = node.body[0].lineno - 1
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        else:
            start = node.lineno
        if start <= line <= end and (best == (line, line) or end - start < best[1] - best[0]):
            best = (start, end)
    return best


def sampled(mutants: list[dict], sample: int | None) -> list[dict]:
    """The first ``sample`` mutants in a fixed pseudo-random order (sha256 of the key): a larger sample
    extends a smaller one, so runs with growing ``--sample`` resume each other."""
    if sample is None:
        return mutants
    return sorted(mutants, key=lambda m: hashlib.sha256(mutant_key(m).encode()).hexdigest())[:sample]


def run_group(name: str, group: Group, results: dict, work: Path, tree: Path, rerun_survivors: bool, limit: int | None,
              sample: int | None = None, results_path: Path = RESULTS) -> None:
    cover = coverage_map(name, group, tree, work)
    equivalent = load_equivalent(results)
    todo = []
    for relative in group.sources:
        source = (ROOT / relative).read_text()
        source_sha = _sha(source)
        if results["sources"].get(relative) != source_sha:  # module changed: its old results are stale
            results["mutants"] = {k: v for k, v in results["mutants"].items() if v["module"] != relative}
            results["sources"][relative] = source_sha
        mutants = enumerate_mutants(ROOT / relative, relative, group.functions.get(relative), group.skip.get(relative),
                                    group.operators)
        chosen = {mutant_key(m) for m in sampled([m for m in mutants if m["operator"] not in group.unsampled], sample)}
        chosen |= {mutant_key(m) for m in mutants if m["operator"] in group.unsampled}
        for m in mutants:
            key = mutant_key(m)
            done = results["mutants"].get(key)
            if done is None and key in chosen or (done and rerun_survivors and done["status"] not in KILLED
                                                  and key not in equivalent):
                todo.append((key, m, source))
    print(f"[{name}] {len(todo)} mutants to run", flush=True)
    out = work / "child.json"
    for count, (key, m, source) in enumerate(todo[:limit] if limit else todo, 1):
        mutated = mutated_source(source, m["operator"], m["occurrence"])
        entry = dict(m, group=name, diff=short_diff(source, mutated) if mutated else "")
        tests = tests_for_lines(cover, m["module"], m["line"], m["end_line"])
        if not tests:  # a continuation line: coverage knows its statement by the statement's first line
            tests = tests_for_lines(cover, m["module"], *statement_lines(source, m["line"]))
        if mutated is None:
            entry.update(status="not_applied", tests=0, seconds=0.0)
        elif not tests:
            entry.update(status="no_tests", tests=0, seconds=0.0)
        else:
            target = tree / m["module"]
            budget = 60 + 10 * sum(cover["durations"].get(t, 1.0) for t in tests)
            target.write_text(mutated)
            try:
                if out.exists():
                    out.unlink()
                exit_code, seconds = _in_child(tree, _test_run(tests), budget, out)
            finally:
                target.write_text(source)
            failed = json.loads(out.read_text())["failed"] if exit_code is not None and out.exists() else []
            if exit_code is None:
                status = "timeout"
            elif exit_code == 0:
                status = "survived"
            elif exit_code < 0:  # the test process died of a signal (e.g. SIGFPE in a kernel): the mutant is seen
                status = "crashed"
            elif exit_code in (1, 2, 3, 4) or failed:
                # 2 (collection errors), 3 (the child failed), 4 (conftest import failed): the mutant broke
                # importing the package, which any test run shows
                status = "killed"
            else:
                status = f"error_{exit_code}"
            entry.update(status=status, tests=len(tests), killed_by=failed[:1], seconds=round(seconds, 1))
        results["mutants"][key] = entry
        _write_json_atomic(results_path, results)
        print(f"[{name}] {count}/{len(todo)} {entry['status']:<11} {key} ({entry.get('seconds', 0)} s, "
              f"{entry['tests']} tests) {entry['diff'].splitlines()[-1] if entry['diff'] else ''}", flush=True)


def write_report(results: dict, groups: dict[str, Group] | None = None, survivors_path: Path = SURVIVORS) -> None:
    groups = GROUPS if groups is None else groups
    equivalent = load_equivalent(results)
    rows, survivors, equivalents, skipped = [], [], [], []
    for name, group in groups.items():
        for module in group.sources:
            in_scope = {mutant_key(m) for m in enumerate_mutants(ROOT / module, module, group.functions.get(module),
                                                                 group.skip.get(module), group.operators)}
            total = len(in_scope)
            entries = {k: v for k, v in results["mutants"].items() if k in in_scope and v.get("group") == name}
            skipped.extend(f"- `{module}` `{function}`: {reason}" for function, reason in group.skip.get(module, {}).items())
            if not entries:
                rows.append(f"| {module} | {name} | not run (0 of {total}) | | | | | |")
                continue
            killed = sum(v["status"] in KILLED for v in entries.values())
            equiv = [k for k, v in entries.items() if v["status"] not in KILLED and k in equivalent]
            alive = [k for k, v in entries.items() if v["status"] not in KILLED and k not in equivalent
                     and v["status"] != "not_applied"]
            judged = killed + len(alive)
            rate = f"{100 * killed / judged:.1f} %" if judged else "-"
            state = "complete" if len(entries) >= total else f"partial ({len(entries)} of {total})"
            rows.append(f"| {module} | {name} | {state} | {len(entries)} | {killed} | {len(equiv)} | {len(alive)} | {rate} |")
            for k in sorted(equiv, key=lambda k: (entries[k]["line"], k)):
                equivalents.append(f"- `{k}` line {entries[k]['line']}: `{entries[k]['diff'].splitlines()[-1][2:]}`: "
                                   f"{equivalent[k]['reason']}")
            for k in sorted(alive, key=lambda k: (entries[k]["line"], k)):
                v = entries[k]
                survivors.append(f"- `{k}` line {v['line']} in `{v['function']}` ({v['status']}):\n"
                                 + "\n".join(f"      {line}" for line in v["diff"].splitlines()))
    scope = {mutant_key(m) for name, group in groups.items() for module in group.sources
             for m in enumerate_mutants(ROOT / module, module, group.functions.get(module), group.skip.get(module),
                                        group.operators)}
    total = [v for k, v in results["mutants"].items() if k in scope]
    killed = sum(v["status"] in KILLED for v in total)
    alive = sum(v["status"] not in KILLED and mutant_key(v) not in equivalent and v["status"] != "not_applied" for v in total)
    text = [
        "# Mutation testing: kill rate and survivors",
        "",
        "Written by `bench/mutation.py` (cosmic-ray 8.7.0 operators; see its docstring and docs/testing.md).",
        "Kill rate = killed / (mutants - equivalent). A timeout or a crash (the test process killed by a signal)",
        "counts as killed; `no_tests` (no test executes the line) counts as a survivor. Equivalent mutants, with",
        "reasons: bench/mutation_equivalent.json.",
        "",
        "| module | group | state | mutants | killed | equivalent | surviving | kill rate |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"All modules run so far: {killed} killed, {alive} surviving"
        + (f", kill rate {100 * killed / (killed + alive):.1f} %." if killed + alive else "."),
        "",
        "## Surviving mutants",
        "",
        *(survivors or ["None."]),
        "",
        "## Left out (no CPU test can run them)",
        "",
        *(skipped or ["None."]),
        "",
        "## Equivalent mutants (from bench/mutation_equivalent.json)",
        "",
        *(equivalents or ["None."]),
        "",
    ]
    survivors_path.write_text("\n".join(text))
    print(f"wrote {survivors_path.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", action="append", choices=[*GROUPS, *BOUNDARY_GROUPS],
                        help="group to run (repeat; default all of the pass)")
    parser.add_argument("--boundary", action="store_true", help="the boundary pass: BOUNDARY_GROUPS, BOUNDARY_OPERATORS, "
                        "results in mutation_boundary.json")
    parser.add_argument("--rerun-survivors", action="store_true", help="test surviving mutants again (after adding tests)")
    parser.add_argument("--limit", type=int, help="stop after this many mutants per group")
    parser.add_argument("--sample", type=int, help="run only this many mutants per module (a fixed pseudo-random "
                        "subset; a larger --sample later extends it)")
    parser.add_argument("--report", action="store_true", help="only rewrite the survivors list from the results")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK, help=f"scratch copy of the tree (default {DEFAULT_WORK})")
    parser.add_argument("--venv", type=Path, default=Path(os.environ.get("HF_POSEXT_MUTATION_VENV", DEFAULT_VENV)))
    args = parser.parse_args()

    groups = BOUNDARY_GROUPS if args.boundary else GROUPS
    results_path, survivors_path = (BOUNDARY_RESULTS, BOUNDARY_SURVIVORS) if args.boundary else (RESULTS, SURVIVORS)
    unknown = [name for name in args.group or [] if name not in groups]
    if unknown:
        parser.error(f"--group {unknown[0]} is not a group of the {'boundary' if args.boundary else 'standard'} pass")
    results = load_results(results_path, BOUNDARY_OPERATORS if args.boundary else OPERATORS)
    try:
        import cosmic_ray  # noqa: F401
        import coverage  # noqa: F401
    except ImportError:
        python = args.venv / "bin" / "python"
        if not python.exists() or os.environ.get("HF_POSEXT_MUTATION_REEXEC"):
            raise SystemExit(f"cosmic-ray and coverage are not importable and {python} does not exist: set up the venv "
                             "as the docstring of bench/mutation.py says, or pass --venv.")
        os.environ["HF_POSEXT_MUTATION_REEXEC"] = "1"
        os.execv(str(python), [str(python), *sys.argv])

    if args.report:
        write_report(results, groups, survivors_path)
        return
    # `kill PID` stops like Ctrl-C: the mutated file is restored, the running child killed, results kept.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    tree = refresh_tree(args.work_dir)
    _preload()
    try:
        for name in args.group or list(groups):
            run_group(name, groups[name], results, args.work_dir, tree, args.rerun_survivors, args.limit, args.sample,
                      results_path)
            write_report(results, groups, survivors_path)
    except KeyboardInterrupt:
        write_report(results, groups, survivors_path)
        raise SystemExit(f"stopped; {len(results['mutants'])} results kept in {results_path.relative_to(ROOT)}: run the same "
                         "command to go on")


if __name__ == "__main__":
    main()
