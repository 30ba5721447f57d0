#!/usr/bin/env bash
# Makes (or brings up to date) the transformers-4.57 environment the tests use beside the newest transformers:
#   bash scripts/tf457_venv.sh [FOLDER] [--link-only]   (default .venv-tf457; scripts/test.sh calls it)
# PYTHON (default python3) is the caller's interpreter: the system Python, a venv's or a conda env's.
#
# The 4.57 venv has transformers 4.57.x (and what it needs that the caller's versions do not satisfy) in its own
# site-packages, and sees every other package through the caller's site-packages: a file
# `_hf_posext_caller_site.pth` in its site-packages adds them with site.addsitedir, after its own. So torch is not
# downloaded again, and its own transformers 4.57 is found before the caller's 5.x. This works whatever the caller
# is: `python -m venv --system-site-packages` from a venv would see the *base* interpreter's packages, not the
# venv's (no torch there), which is why the caller's folders are named explicitly. The .pth file is rewritten
# on every run, so the venv follows the caller that ran last; a venv made by another Python version is remade.
#
# --link-only makes the venv and writes the .pth file, and installs nothing, not even pip (no network, a second).
# Pins that keep pip's resolver satisfied, so the set-up prints no "ERROR: pip's dependency resolver ..." line:
#   * datasets<5: transformers 4.57 needs huggingface-hub<1, which datasets 5.x refuses (it needs >=1.31);
#     datasets 4.x accepts both, so the venv gets a datasets that works with its huggingface-hub.
#   * kernels>=0.6.1,<=0.9 (the range transformers 4.57 names): transformers 5.x brings kernels 0.19, which needs
#     huggingface-hub>=1.32; the venv's own older kernels shadows it.
#   * setuptools>=77.0.3: a venv of Python 3.11 carries its own setuptools 65, which shadows the caller's and is
#     older than torch 2.13 requires.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-tf457
LINK_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --link-only) LINK_ONLY=1 ;;
    -*) echo "tf457_venv.sh: unknown option $arg (expected: [FOLDER] [--link-only])" >&2; exit 2 ;;
    *) VENV=$arg ;;
  esac
done

caller_version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [[ -e "$VENV" && ! -f "$VENV/pyvenv.cfg" ]]; then
  echo "tf457_venv.sh: $VENV exists and is not a venv (no pyvenv.cfg); remove it or name another folder" >&2
  exit 1
fi
remake=0
if [[ ! -x "$VENV/bin/python" ]]; then
  remake=1
elif [[ "$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" != "$caller_version" ]]; then
  remake=1   # made by another Python version: the caller's compiled packages (torch) would not load in it
elif grep -qi '^include-system-site-packages *= *true' "$VENV/pyvenv.cfg"; then
  remake=1   # made by an older version of this script, which saw the base interpreter's packages
fi
if [[ $remake == 1 ]]; then
  "$PY" -m venv --clear --without-pip "$VENV"
fi

venv_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
if [[ $LINK_ONLY == 0 && ! -x "$VENV/bin/pip" ]]; then
  # The venv's own pip, installed before the caller's folders are linked (ensurepip would take the caller's as there).
  rm -f "$venv_site/_hf_posext_caller_site.pth"
  "$VENV/bin/python" -m ensurepip --upgrade >/dev/null
fi
# The caller's site folders, in its own order (a venv's, a conda env's, the system's, the user's), less the 4.57
# venv's own; site.addsitedir also reads their .pth files (an editable install of hf-posext, for one).
caller_site=$("$PY" - "$venv_site" <<'EOF'
import os, site, sys
venv_site = os.path.realpath(sys.argv[1])
known = set(site.getsitepackages())
if site.ENABLE_USER_SITE:
    known.add(site.getusersitepackages())
folders = []
for entry in sys.path:
    if not entry or not os.path.isdir(entry):
        continue
    if entry in known or os.path.basename(entry) in ("site-packages", "dist-packages"):
        if os.path.realpath(entry) == venv_site:
            sys.exit("tf457_venv.sh: PYTHON is the 4.57 venv's own python; run it with the python that has torch")
        if entry not in folders:
            folders.append(entry)
print("# Written by scripts/tf457_venv.sh: the site-packages of " + sys.executable + ", after this venv's own.")
print("import site; list(map(site.addsitedir, %r))" % (folders,))
EOF
)
printf '%s\n' "$caller_site" > "$venv_site/_hf_posext_caller_site.pth"

if [[ $LINK_ONLY == 0 ]]; then
  "$VENV/bin/python" -m pip install --quiet "transformers>=4.57,<4.58" "datasets<5" "kernels>=0.6.1,<=0.9" \
    "setuptools>=77.0.3"
fi
