#!/usr/bin/env bash
# The dependency floors of pyproject.toml, checked (`make check-floors`, ~10 minutes on 2 cores; needs
# PyPI): a fresh venv gets the oldest releases the floors allow (uv's --resolution lowest-direct) of the
# core dependencies and of the [dev] test tools that need no torch, then the suite runs there without
# torch (the torch tests skip). A floor that is too low shows up as a failing test or an import error.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${FLOORS_VENV:-$ROOT/.venv-floors}
PYTHON=${PYTHON:-python3}
"$PYTHON" -m venv "$VENV.uv" && "$VENV.uv/bin/python" -m pip install -q uv
UV="$VENV.uv/bin/uv"
REQS=$(mktemp)
trap 'rm -f "$REQS"' EXIT
"$PYTHON" - "$ROOT/pyproject.toml" > "$REQS" <<'PY'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
wanted = list(project["dependencies"]) + extras["xarray"]
wanted += [r for r in extras["dev"] if not r.startswith("repsim-toolkit")
           and re.match(r"[A-Za-z0-9_.-]+", r).group(0) not in ("ckatorch", "rsatoolbox", "calibrated-similarity")]  # these need torch
print("\n".join(wanted))
PY
rm -rf "$VENV"
"$UV" venv -q -p "$PYTHON" "$VENV"
"$UV" pip install -q -p "$VENV/bin/python" --resolution lowest-direct -r "$REQS"
"$UV" pip install -q -p "$VENV/bin/python" --no-deps -e "$ROOT"
"$UV" pip list -p "$VENV/bin/python" 2>/dev/null | grep -iE "^(numpy|scipy|scikit-learn|zarr|numcodecs|google-crc32c|dask|distributed|matplotlib|pandas|xarray|pyarrow|array-api-strict) "
if "$VENV/bin/python" -c "import torch" 2>/dev/null; then echo "check-floors: torch is in the floors venv" >&2; exit 1; fi
cd "$ROOT"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${JOBS:-2}" "$@"
echo "check-floors: the suite passes at the dependency floors"
