#!/usr/bin/env bash
# One call on a lent GPU machine (issues 26, 45): install the wheels carried in .whl/, run the CUDA tests,
# then every row of bench/gpu.py; logs and results land in $OUT (or bench/results without one).
#
# The device image (Python 3.12, torch 2.11 + cu130, CuPy 14 for CUDA 13, torchvision, timm, transformers,
# scipy, scikit-learn, pandas, matplotlib, xarray, pytest) lacks zarr, numcodecs, dask, distributed, nvCOMP and
# pytorch-cka, and reaches no package index. Once, in the checkout the device call sends (the session's, not
# a helper's worktree): download them for Python 3.12 into .whl/ (ignored by git; ~39 MB, 30 of them nvCOMP):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
#     zarr numcodecs donfig msgspec google-crc32c crc32c dask distributed partd locket tblib tornado zict \
#     array-api-strict pytorch-cka nvidia-nvcomp-cu13 nvidia-libnvcomp-cu13
# then run this with `carry: [".whl"]` and `timeout_s: 560`, e.g. `GPU_BENCH_S=400 bash bench/gpu_device.sh`:
# at most ~8 minutes (installs ~20-30 s, the CUDA tests <= 75 s, bench/gpu.py <= GPU_BENCH_S: every row runs in
# a process group of its own, killed at its timeout or when the budget is spent, so a hung row cannot eat the
# call). bench/gpu.py copies gpu.json and RESULTS.md into $OUT after every row, so a call cut off by its limit
# still brings back the rows it finished. A session's 15 device minutes (start included) hold one such call;
# the heatmap at 8,192 images (the issue's >= 4x pytorch-cka row; ~18 GB of stores, several minutes) needs a
# second call on the warm machine: first copy the first call's gpu.json into bench/results/ and its RESULTS.md
# into bench/ here (the device's copies of tracked files are replaced by this tree's), then
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
    --heatmap-timeout "$(( ${HEATMAP_S:-540} - 15 ))" --budget "$(( ${HEATMAP_S:-540} - 10 ))" --merge
else
  step 75 python3 -m pytest -q -p no:cacheprovider -n 4 -rs tests/test_cka_device.py tests/test_engine.py::test_cuda_device_matches_cpu \
    tests/test_engine.py::test_cuda_chunks_decoded_by_nvcomp_match_the_cpu_decoded_pass \
    tests/test_extract_models.py::test_weights_sha256_of_a_device_module_equals_the_host_one tests/test_extract_memory.py \
    tests/test_extract_jpeg.py::test_nvjpeg_route_is_chosen_and_matches_the_cpu_decoder \
    tests/test_extract_jobs.py::test_threads_on_one_gpu_write_the_stores_of_one_at_a_time_runs
  # the heatmap first (the headline, at most HEATMAP_S), then the 16-block extraction, the stores decoded on the
  # GPU (n = 4,096: half the store-making time of 8,192) and the JPEG folder; the whole at most GPU_BENCH_S - 10
  step "${GPU_BENCH_S:-400}" python3 bench/gpu.py --extract --heatmap --jpeg --n "${STORE_N:-4096}" \
    --heatmap-timeout "${HEATMAP_S:-250}" --budget "$(( ${GPU_BENCH_S:-400} - 10 ))" ${GPU_BENCH_ARGS:-}
fi
[ -n "${GPU_OOC:-}" ] && step 240 python3 bench/ooc.py --device cuda
[ "$OUT" != bench/results ] && cp bench/RESULTS.md bench/results/gpu.json bench/results/extract_throughput_gpu.json \
  bench/results/heatmap18_gpu*.json bench/results/ooc_cuda.json "$OUT"/ 2>/dev/null
ls -la "$OUT"
