#!/usr/bin/env bash
# The Hopper device calls (H200 or H100) that check and time what rounds without a GPU built for
# issues 23 and 28 (the list as of the twenty-third round; docs/prefill-kernel-next.md). One
# device call per mode, each under the tool's 600 s; everything is tee'd into $OUT, so a call cut
# off by its time limit keeps its output. No vLLM needed (no Marlin or Humming columns).
#
#   bash scripts/gpu_untimed_kernels.sh check  # about 580 s cold: the GPU tests of the W4A16
#                                              # schedules never run on a GPU and of every A8
#                                              # schedule, then the whole MoE at 4096-16384 tokens
#                                              # (W4A16 and every A8 schedule's column) with the
#                                              # 256-row W4A16 candidates swept, W4A16 only
#   bash scripts/gpu_untimed_kernels.sh small  # about 400 s cold: the 32-route W4A16 candidates
#                                              # at 512 and 1024 tokens against the defaults, in
#                                              # W4A16, A4 and split
#   bash scripts/gpu_untimed_kernels.sh ncu    # about 360 s: Nsight Compute of the FC1 GEMM at the
#                                              # sizes issue 23 lacks a profile for, and of the
#                                              # 256-route register-weights A8 FC1; summarize the
#                                              # CSV here with profile_prefill.py --ncu-summary
#   bash scripts/gpu_untimed_kernels.sh again  # about 400 s cold: what the twenty-third round's
#                                              # check and small left open: A4 and split of the
#                                              # 128-route tiles at 4096 (256-row items as one or
#                                              # two consumer partitions against 128-row ones),
#                                              # the 32-route candidates at 384-1024 in all three
#                                              # modes, the time per kernel of the 4096-16384
#                                              # calls (W4A16, A4), and the A8 columns twice
#                                              # (sizes up, then down) to tell the
#                                              # register-weights A8 schedules from noise
#   bash scripts/gpu_untimed_kernels.sh gather # about 3 minutes: FC1's activation gather in both
#                                              # program orders against a copy (bench_gather.py),
#                                              # then the time per kernel at 4096-16384
#
# The eighteenth round ran this script's earlier form (modes large and small, at 0249d09); the
# twenty-third ran check, small and ncu on an H100 (benchmarks/results/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder the results go to (the device tool sets it)}"
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
UNTESTED_W4A16="rs_w256_t32_d6_ws_c2 or rs_w256_t128_d6_ws_x2_h2 or not_chosen"
LARGE_TILES=rs_w256_t128_d6_ws_x2_h2,rs_w256_t128_d6_ws
SMALL_TILES=rs_w128_t32_d6_ws_c3,rs_w256_t32_d6_ws_c2
MID_TILES=rs_w128_t128_d6_ws,rs_w256_t128_d6_ws,rs_w256_t128_d6_ws_x2_h2
NCU_CASES=(--case 1024:default:w4a16 --case 2048:default:w4a16 --case 16384:default:w4a16 --case 8192:a8_t256_rs)
began=$(date +%s)
left() { echo $(($1 - ($(date +%s) - began))); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv | tee "$OUT/gpu.txt"
case "${1:-}" in
check)
    timeout 240 python -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_triton_prefill_gpu.py \
        -k "$UNTESTED_W4A16" 2>&1 | tee "$OUT/prefill_gpu_tests.txt" | tail -15
    timeout "$(left 510)" python -m pytest -q -p no:cacheprovider -rs -m gpu \
        tests/test_triton_prefill_a8_gpu.py 2>&1 | tee "$OUT/a8_gpu_tests.txt" | tail -15
    timeout "$(left 585)" python benchmarks/bench_moe.py --shapes glm53flash_tp2 --tokens 8192,4096,16384 \
        --baselines "" --sweep prefill --sweep-modes "" --prefill-tiles "$LARGE_TILES" --out "$OUT" 2>&1 \
        | tee "$OUT/bench_moe_large.txt" | grep -v "^{" | tail -20
    ;;
small)
    timeout 585 python benchmarks/bench_moe.py --shapes glm53flash_tp2 --tokens 1024,512 \
        --baselines "" --sweep prefill --prefill-tiles "$SMALL_TILES" --out "$OUT" 2>&1 \
        | tee "$OUT/bench_moe_small.txt" | grep -v "^{" | tail -20
    ;;
ncu)
    timeout 585 ncu --profile-from-start off -k regex:grouped_w4 --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats \
        --page details --csv python benchmarks/profile_prefill.py "${NCU_CASES[@]}" >"$OUT/ncu.csv" \
        2>"$OUT/ncu.err"
    tail -5 "$OUT/ncu.err"
    echo "then here: python benchmarks/profile_prefill.py ${NCU_CASES[*]} --ncu-summary ncu.csv --out DIR"
    ;;
again)
    timeout 170 python benchmarks/bench_moe.py --shapes glm53flash_tp2 --tokens 4096 --baselines "" \
        --sweep prefill --prefill-tiles "$MID_TILES" --out "$OUT/mid" 2>&1 | tee "$OUT/bench_moe_mid.txt" \
        | grep -v "^{" | tail -5
    timeout "$(left 330)" python benchmarks/bench_moe.py --shapes glm53flash_tp2 --tokens 384,512,768,1024 \
        --baselines "" --sweep prefill --prefill-tiles "$SMALL_TILES" --out "$OUT/small" 2>&1 \
        | tee "$OUT/bench_moe_small.txt" | grep -v "^{" | tail -5
    timeout 90 python benchmarks/profile_decode.py --tokens 4096,8192,16384 --a4 --out "$OUT/kernels" 2>&1 \
        | tail -3
    for order in up:2048,4096,8192,16384 down:16384,8192,4096,2048; do
        timeout "$(left 585)" python benchmarks/bench_moe.py --shapes glm53flash_tp2 --tokens "${order#*:}" \
            --baselines "" --out "$OUT/a8_${order%%:*}" 2>&1 | tee "$OUT/bench_moe_a8_${order%%:*}.txt" \
            | grep -v "^{" | tail -5
    done
    ;;
gather)
    timeout 240 python benchmarks/bench_gather.py --out "$OUT" 2>&1 | tee "$OUT/bench_gather.txt" | tail -5
    timeout "$(left 330)" python benchmarks/profile_decode.py --tokens 4096,8192,16384 --a4 --out "$OUT" \
        2>&1 | tee "$OUT/profile_decode.txt" | tail -6
    ;;
*)
    echo "usage: bash scripts/gpu_untimed_kernels.sh check|small|ncu|again|gather (on a Hopper GPU, with OUT set)" >&2
    exit 2
    ;;
esac
