"""The family sweep on another transformers release than the installed one, in a venv of its own.

hf-posext declares ``transformers>=4.57,<6``; the test suite runs on the newest 5.x and on 4.57. This runs
``bench/family_sweep.py`` (every ``*ForCausalLM`` class, every applicable method) against an intermediate release, so
that what a user on that release gets is measured rather than assumed. The venv sees the caller's packages (torch is
not installed again) after its own transformers, and gets the ``kernels`` release that transformers names: a newer
``kernels`` stops transformers 5.0 from importing any model.

Usage:
    python bench/release_sweep.py --transformers 5.10.4             # venv .venv-tf-5.10.4, record in releases/
    python bench/release_sweep.py --transformers 5.0.0 --venv ~/venvs/tf-5.0.0
    python bench/release_sweep.py --summary-only                    # the releases' table again from their records
Results: bench/results/family_sweep/releases/sweep-VERSION.json (as bench/family_sweep.py writes it) and README.md,
one row per release swept. A release's crashes and parity differences are listed there, not raised: exit status 0
when the sweep ran, 2 on bad input, 1 when the venv or the sweep could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import site
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RELEASES = ROOT / "bench" / "results" / "family_sweep" / "releases"
VERSION = re.compile(r"^\d+\.\d+\.\d+$")


def caller_site_folders() -> list[str]:
    """This interpreter's site-packages folders (a venv's, the system's, the user's), in its own order."""
    known = set(site.getsitepackages()) | ({site.getusersitepackages()} if site.ENABLE_USER_SITE else set())
    return [entry for entry in dict.fromkeys(sys.path)
            if entry and os.path.isdir(entry) and (entry in known or os.path.basename(entry) in ("site-packages", "dist-packages"))]


def run(command: list[str], what: str) -> str:
    """Run ``command``; its stdout, or SystemExit(1) naming ``what`` failed and the end of its output."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = ((done.stderr or done.stdout).strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"release_sweep.py: {what} failed (exit {done.returncode}): {last[:300]}")
    return done.stdout


def make_venv(folder: Path, version: str) -> Path:
    """A venv at ``folder`` with transformers ``version`` and the kernels it names, seeing the caller's packages."""
    python = folder / "bin" / "python"
    if folder.exists() and not (folder / "pyvenv.cfg").is_file():
        raise SystemExit(f"release_sweep.py: --venv {folder} exists and is not a venv (no pyvenv.cfg); name another folder")
    created = not python.exists()
    if created:
        run([sys.executable, "-m", "venv", "--without-pip", str(folder)], f"python -m venv {folder}")
        run([str(python), "-m", "ensurepip", "--upgrade"], "ensurepip")  # before the caller's folders are linked
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], "reading the venv").strip()
    (Path(purelib) / "_hf_posext_caller_site.pth").write_text(
        f"import site; list(map(site.addsitedir, {caller_site_folders()!r}))\n")
    try:
        run([str(python), "-m", "pip", "install", "--quiet", f"transformers=={version}"], f"pip install transformers=={version}")
    except SystemExit:
        if created:  # a release pip does not have leaves no venv behind
            shutil.rmtree(folder, ignore_errors=True)
        raise
    kernels = run([str(python), "-c", "from transformers.dependency_versions_table import deps; print(deps.get('kernels', ''))"],
                  "reading transformers' dependency table").strip()
    if kernels:
        run([str(python), "-m", "pip", "install", "--quiet", kernels], f"pip install {kernels}")
    return python


def release_of(record: dict) -> str:
    """The transformers release a record was swept on (``"5.10.4"``, from its ``versions`` line)."""
    return record["versions"].split(",")[0].removeprefix("transformers ").strip()


def swept_on(record: dict) -> str:
    """When and where a release was swept: ``2026-12-07, 2 CPUs x86_64, load 1.9`` (what the record holds of it)."""
    swept = record.get("swept") or {}
    parts = [swept.get("date"), f"{swept['cpus']} CPUs {record.get('machine', '')}".strip() if swept.get("cpus") else record.get("machine")]
    if swept.get("load") is not None:
        parts.append(f"load {swept['load']}")
    return ", ".join(str(part) for part in parts if part) or "?"


def summary_row(record: dict) -> str:
    """One release's line of the table: its totals and, per class that is not all ok, the first finding."""
    totals = record["totals"]
    findings = []
    for row in record["rows"]:
        if not row["built"]:
            findings.append(f"{row['class_name']}: not built ({row['reason'][:90]})")
            continue
        bad = [m for m in row["methods"] if m["outcome"] not in ("ok", "refused")]
        if bad:
            findings.append(f"{row['class_name']}: {', '.join(m['method'] for m in bad)}: {bad[0]['reason'][:120]}")
    listed = "<br>".join(f.replace("|", "/") for f in findings) or "none"
    return (f"| {release_of(record)} | {totals['classes']} | {totals['built']} | "
            f"{totals['pairs']} | {totals['ok']} | {totals['refused']} | {totals['crash']} | {record.get('seconds', '?')} | {swept_on(record)} | {listed} |")


def write_summary() -> Path:
    """``releases/README.md``: one row per ``sweep-*.json`` record there, oldest release first."""
    records = []
    for path in RELEASES.glob("sweep-*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as error:
            raise SystemExit(f"release_sweep.py: {path} is not a sweep record ({error}); run that release again")
    key = lambda r: tuple(int(p) for p in release_of(r).split("."))  # noqa: E731  (5.9 before 5.10)
    lines = ["# The family sweep on other transformers releases (`bench/release_sweep.py`)", "",
             "Each row: `python bench/release_sweep.py --transformers VERSION` (tiny random models, the same checks as "
             "[the support matrix](../../../../docs/families.md)). A crash or parity difference is listed with its first "
             "line; a class not built is a tiny recipe written for the newest release.", "",
             "seconds: the sweep's own clock, the venv's set-up not counted; load: the 1-minute load average before it.", "",
             "| transformers | classes | built | pairs | ok | refused | crash | seconds | swept on | not ok |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    try:
        lines += [summary_row(r) for r in sorted(records, key=key)]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        raise SystemExit(f"release_sweep.py: a record in {RELEASES} lacks a sweep's fields ({error!r}); run that release again")
    from hf_posext.core.files import write_text_atomic

    out = RELEASES / "README.md"
    write_text_atomic(out, "\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transformers", help="the release to sweep, e.g. 5.10.4")
    parser.add_argument("--venv", type=Path, help="its venv (default: .venv-tf-VERSION in the repository)")
    parser.add_argument("--summary-only", action="store_true", help="write releases/README.md again; sweep nothing")
    args = parser.parse_args(argv)
    if args.summary_only:
        print(write_summary())
        return 0
    if not args.transformers or not VERSION.match(args.transformers):
        parser.error(f"--transformers needs a release such as 5.10.4, got {args.transformers!r}")
    import transformers

    if args.transformers == transformers.__version__:
        parser.error(f"transformers {args.transformers} is the installed one: run python bench/family_sweep.py")
    from hf_posext.core.locks import FolderBusyError, hold_folder

    RELEASES.mkdir(parents=True, exist_ok=True)
    try:  # one run a release: its venv and its record (runs of other releases go on beside it)
        with hold_folder(RELEASES, option="the releases folder", what="another release", part=f"release {args.transformers}"):
            out = sweep_release(args.transformers, args.venv or ROOT / f".venv-tf-{args.transformers}")
    except FolderBusyError as error:
        raise SystemExit(f"release_sweep.py: {error}")
    print(f"{out} and {write_summary()}")
    return 0


def sweep_release(version: str, venv: Path) -> Path:
    """Sweep ``version`` in ``venv`` and write its record (an earlier record stays until the sweep has finished)."""
    from hf_posext.core.files import write_text_atomic

    started = time.time()
    python = make_venv(venv, version)
    out = RELEASES / f"sweep-{version}.json"
    fresh = RELEASES / f".sweep-{version}.{os.getpid()}.running.json"
    load = round(os.getloadavg()[0], 1)
    try:
        done = subprocess.run([str(python), str(ROOT / "bench" / "family_sweep.py"), "--out", str(fresh), "--no-docs"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if not fresh.is_file() or done.returncode not in (0, 1):  # 1: results differ from known.py, as expected here
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise SystemExit(f"release_sweep.py: the sweep on transformers {version} did not finish "
                             f"(exit {done.returncode}): {last}")
        # the record names no machine path: a save's temporary folder reads SAVED, the repository is left out
        record = json.loads(re.sub(r"/tmp/tmp[\w-]+/", "SAVED/", fresh.read_text()).replace(f"{ROOT}/", ""))
    finally:
        fresh.unlink(missing_ok=True)
    record["swept"] = {"date": time.strftime("%Y-%m-%d", time.gmtime(started)), "cpus": os.cpu_count(), "load": load,
                       "command": f"python bench/release_sweep.py --transformers {version}"}
    write_text_atomic(out, json.dumps(record, indent=1) + "\n")
    return out

if __name__ == "__main__":
    sys.exit(main())
