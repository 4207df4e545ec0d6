#!/usr/bin/env bash
# The analysis core in a real fresh venv (`make check-core`, a few minutes): `pip install .` without
# extras must not bring torch, and `import repsim`, `repsim check` and `repsim cka` must work on a store
# while `repsim extract` exits 2 naming repsim-toolkit[torch]. tests/test_install_split.py is the fast
# equivalent the suite runs.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${CORE_VENV:-$ROOT/.venv-core}
PYTHON=${PYTHON:-python3}
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$ROOT"
for fw in torch torchvision timm transformers; do
    if "$VENV/bin/python" -c "import $fw" 2>/dev/null; then echo "check-core: $fw was installed with the core" >&2; exit 1; fi
done
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
"$VENV/bin/python" -c '
import numpy as np, repsim
rng = np.random.default_rng(0)
X = rng.standard_normal((256, 12)).astype(np.float32)
repsim.save_store("a.zarr", layers={"x": X, "y": np.tanh(X)}, labels=rng.integers(0, 3, 256))
'
"$VENV/bin/repsim" check a.zarr
"$VENV/bin/repsim" cka a.zarr --out cka.npz --batch-size 64 --epochs 1 --no-progress
set +e
"$VENV/bin/repsim" extract --checkpoint torchvision:resnet18 --data digits --split test --out r18.zarr 2>err.txt
rc=$?
set -e
cat err.txt
if [ "$rc" -ne 2 ] || ! grep -q "pip install 'repsim-toolkit\[torch\]'" err.txt || grep -q Traceback err.txt; then
    echo "check-core: repsim extract should exit 2 naming repsim-toolkit[torch] (rc $rc)" >&2; exit 1
fi
echo "check-core: the analysis core installs and runs without torch"
