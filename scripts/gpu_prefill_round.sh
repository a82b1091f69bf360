#!/usr/bin/env bash
# One H200 round of the Hopper prefill GEMM (issues 23 and 28): its GPU tests (W4A16/A4/split and A8), the benchmark of every
# schedule, Nsight Compute sections of the cases given as arguments (TOKENS:SCHEDULE, or TOKENS:a8 for
# the A8 GEMM), and the
# SASS instruction mix of the compiled prefill kernels. Everything goes under $OUT (device tool).
# Optional: TEST_FILTER (a pytest -k expression within the prefill GPU tests) and SCHEDULES (labels
# for the benchmark, space-separated) narrow a round.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout 170 python -m pytest -q -p no:cacheprovider -m gpu tests -k "(test_triton_prefill_gpu or test_triton_prefill_a8_gpu)${TEST_FILTER:+ and ($TEST_FILTER)}" 2>&1 | tee "$OUT/prefill_gpu_tests.txt" | tail -5
timeout 320 python benchmarks/bench_prefill_gemm.py --out "$OUT" ${SCHEDULES:+--schedules $SCHEDULES} 2>&1 | tee "$OUT/bench_prefill_gemm.txt" | grep -v "^{" | tail -5
cases=()
for case in "$@"; do cases+=(--case "$case"); done
timeout 90 /usr/local/cuda/bin/ncu --profile-from-start off -k regex:grouped_w4 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section SchedulerStats --page details --csv \
    python benchmarks/profile_prefill.py "${cases[@]}" > "$OUT/profile_prefill_ncu.csv" 2> "$OUT/ncu_stderr.txt"
echo "ncu exit $?"
for cubin in $(find ~/.triton/cache -name "grouped_w4_gemm*.cubin"); do
    echo "== $cubin"
    /usr/local/cuda/bin/cuobjdump -sass "$cubin" | grep -oE "^\s+/\*[0-9a-f]+\*/\s+[A-Z0-9_.]+" | awk '{print $2}' | sort | uniq -c | sort -rn | head -25
done > "$OUT/sass_mix.txt" 2>&1
python -c "import triton; print('triton', triton.__version__)" >> "$OUT/sass_mix.txt"
