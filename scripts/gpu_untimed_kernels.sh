#!/usr/bin/env bash
# The two H200 device calls that first checked and timed what the sixteenth and seventeenth
# rounds of issues 23 and 28 built on the CPU only (run in the eighteenth round, 2026-12-05:
# benchmarks/results/README.md, "eighteenth round", items 1 and 2). One device call per mode;
# everything is tee'd into $OUT, so a call cut off by its time limit keeps its output.
#
#   bash scripts/gpu_untimed_kernels.sh large   # about 270 s: the prefill and A8 GPU tests, then
#                                               # the whole MoE at 4096-16384 tokens (W4A16, A4,
#                                               # split, a8, a8_x2, a8_t256; no vLLM baselines)
#   bash scripts/gpu_untimed_kernels.sh small   # about 300 s cold: the small warp-specialized
#                                               # tiles (two or three CTAs per SM, dequantize-ahead)
#                                               # at 512-2048 tokens against the defaults, W4A16
#                                               # only (each schedule compiles its own kernels)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder the results go to (the device tool sets it)}"
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
SMALL_TILES=rs_w128_t32_d6_ws_c3,rs_w128_t64_d6_ws_c2,ws_t32_d6_c2,ws_t16_d8_c3,ws_t32_d6_x2_c2,ws_t32_d6,ws_t32_d6_x2
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv | tee "$OUT/gpu.txt"
case "${1:-}" in
large)
    timeout 300 python -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_triton_prefill_gpu.py \
        tests/test_triton_prefill_a8_gpu.py 2>&1 | tee "$OUT/prefill_gpu_tests.txt" | tail -15
    timeout 250 python benchmarks/bench_moe.py --shapes glm53flash_tp2 --tokens 4096,8192,16384 \
        --baselines "" --out "$OUT" 2>&1 | tee "$OUT/bench_moe.txt" | grep -v "^{" | tail -20
    ;;
small)
    timeout 550 python benchmarks/bench_moe.py --shapes glm53flash_tp2 --tokens 512,1024,2048 \
        --baselines "" --sweep prefill --prefill-tiles "$SMALL_TILES" --sweep-modes "" --out "$OUT" 2>&1 \
        | tee "$OUT/bench_moe_small_tiles.txt" | grep -v "^{" | tail -30
    ;;
*)
    echo "usage: bash scripts/gpu_untimed_kernels.sh large|small (on the H200, with OUT set)" >&2
    exit 2
    ;;
esac
