#!/usr/bin/env bash
# One call on a lent GPU machine (issue 26): install the wheels carried in .whl/, run the CUDA tests,
# then every row of bench/gpu.py; logs and results land in $OUT (or bench/results without one).
#
# The device image has torch, torchvision, CuPy and pytest but not zarr, numcodecs, dask or distributed,
# and reaches no package index. Once, here: download them for Python 3.12 into .whl/ (ignored by git):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     zarr numcodecs donfig msgspec google-crc32c crc32c dask distributed partd locket tblib tornado zict \
#     array-api-strict pytorch-cka nvidia-nvcomp-cu13 nvidia-libnvcomp-cu13
# then run this with `carry: [".whl"]` and `timeout_s: 560`, e.g. `GPU_BENCH_S=380 bash bench/gpu_device.sh`:
# about 8 minutes (installs ~20 s, the CUDA tests <= 75 s, bench/gpu.py <= GPU_BENCH_S with the 18-network
# heatmap at 2,048 images bounded by HEATMAP_S). bench/gpu.py copies gpu.json and RESULTS.md into $OUT after
# every row, so a call cut off by its limit still brings back the rows it finished. A session's 15 device
# minutes (start included) hold one such call; the heatmap at 8,192 images (the issue's >= 4x pytorch-cka
# row; ~18 GB of stores, several minutes) needs a second call on the warm machine: first copy the first
# call's gpu.json into bench/results/ and its RESULTS.md into bench/ here (the device's copies of tracked
# files are replaced by this tree's), then
#   HEATMAP_ONLY=8192 HEATMAP_S=540 bash bench/gpu_device.sh
# which skips the tests and the other rows and merges its row into the same gpu.json and ## gpu section.
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
L=$OUT/gpu.log
step() { local t=$1; shift; echo "=== $(date +%T) [$t s] $*" | tee -a "$L"; timeout "$t" "$@" 2>&1 | tee -a "$L"; echo "=== rc=${PIPESTATUS[0]}" | tee -a "$L"; }
nvidia-smi -L | tee -a "$L"
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -3 | tee -a "$L"
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3 | tee -a "$L"
if [ -n "${HEATMAP_ONLY:-}" ]; then
  step "${HEATMAP_S:-540}" python3 bench/gpu.py --skip-allpairs --skip-store --heatmap --heatmap-n "$HEATMAP_ONLY" \
    --heatmap-timeout "$(( ${HEATMAP_S:-540} - 15 ))" --merge
else
  step 75 python3 -m pytest -q -p no:cacheprovider -n 4 -rs tests/test_cka_device.py tests/test_engine.py::test_cuda_device_matches_cpu \
    tests/test_extract_models.py::test_weights_sha256_of_a_device_module_equals_the_host_one tests/test_extract_memory.py
  step "${GPU_BENCH_S:-380}" python3 bench/gpu.py --extract --heatmap --heatmap-timeout "${HEATMAP_S:-200}" ${GPU_BENCH_ARGS:-}
fi
[ -n "${GPU_OOC:-}" ] && step 240 python3 bench/ooc.py --device cuda
[ "$OUT" != bench/results ] && cp bench/RESULTS.md bench/results/gpu.json bench/results/extract_throughput_gpu.json \
  bench/results/heatmap18_gpu*.json bench/results/ooc_cuda.json "$OUT"/ 2>/dev/null
ls -la "$OUT"
