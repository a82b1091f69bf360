#!/usr/bin/env bash
# The Hopper device calls (H200 or H100) that check and time what rounds without a GPU built for
# issues 23 and 28 (the list as of the twenty-fourth round, the comparisons turned around in the
# twenty-fifth, which chose the _tok forms: the sweeps now time the forms that gather FC1's rows
# before the launch against the defaults; docs/prefill-kernel-next.md). One
# device call per mode, each under the tool's 600 s; everything is tee'd into $OUT, so a call cut
# off by its time limit keeps its output. No vLLM needed (no Marlin or Humming columns).
#
#   bash scripts/gpu_untimed_kernels.sh gather # 101 s on a fresh H200: FC1's activation gather
#                                              # in both program orders against a copy, and the
#                                              # _tok FC1's [T, K] column permutation three ways
#                                              # (bench_gather.py); the whole MoE at 8192 and
#                                              # 16384 tokens (every A8 schedule's column, the
#                                              # _tok ones too) with the 256-route gathering
#                                              # tiles swept (W4A16, split); the time per kernel
#                                              # at 8192 (default and gathering tiles)
#   bash scripts/gpu_untimed_kernels.sh mid    # 178 s on the H200 after gather: the GPU tests
#                                              # of the _tok schedules (FC1 rows copied by
#                                              # token; W4A16, A4, split and A8); the 128-route
#                                              # _tok tiles at 4096 tokens against their
#                                              # gathering forms in W4A16, A4 and split; the
#                                              # time per kernel at 4096 (W4A16, A4; default
#                                              # and gathering tiles)
#   bash scripts/gpu_untimed_kernels.sh small  # 56 s on the H200 after mid: the 32- and 64-route
#                                              # gathering tiles (two CTAs per SM) at 1024, 2048
#                                              # and 512 tokens against the defaults, in W4A16,
#                                              # A4 and split
#   bash scripts/gpu_untimed_kernels.sh ncu    # about 360 s: Nsight Compute of the FC1 GEMM of
#                                              # the W4A16 defaults at 1024, 2048 and 16384 tokens
#                                              # and of the 256-route register-weights A8 FC1;
#                                              # summarize the CSV here with profile_prefill.py
#                                              # --ncu-summary
#
# The eighteenth round ran this script's earlier form (modes large and small, at 0249d09); the
# twenty-third ran its modes check, small, ncu and again (the form at 8e82a84) on an H100, the
# twenty-fifth gather, mid and small (the form at b254aaa, _tok tiles swept) on an H200
# (benchmarks/results/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder the results go to (the device tool sets it)}"
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
LARGE_GATHER=rs_w128_t256_d4_ws_x2_h2
MID_TILES=rs_w256_t128_d6_ws,rs_w256_t128_d6_ws_tok,rs_w256_t128_d6_ws_x2_h2,rs_w256_t128_d6_ws_x2_h2_tok
SMALL_GATHER=rs_w256_t32_d6_ws_c2,rs_w128_t64_d6_ws_c2
NCU_CASES=(--case 1024:default:w4a16 --case 2048:default:w4a16 --case 16384:default:w4a16 --case 8192:a8_t256_rs)
began=$(date +%s)
left() { echo $(($1 - ($(date +%s) - began))); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv | tee "$OUT/gpu.txt"
case "${1:-}" in
gather)
    timeout 120 python benchmarks/bench_gather.py --out "$OUT" 2>&1 | tee "$OUT/bench_gather.txt" | tail -5
    timeout "$(left 500)" python benchmarks/bench_moe.py --shapes glm53flash_tp2 --tokens 8192,16384 \
        --baselines "" --sweep prefill --sweep-modes split --prefill-tiles "$LARGE_GATHER" --out "$OUT/large" 2>&1 \
        | tee "$OUT/bench_moe_large.txt" | grep -v "^{" | tail -8
    timeout "$(left 585)" python benchmarks/profile_decode.py --tokens 8192 --prefill-tiles "$LARGE_GATHER" \
        --out "$OUT/kernels" 2>&1 | tee "$OUT/profile_decode.txt" | tail -4
    ;;
mid)
    timeout 240 python -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_triton_prefill_gpu.py \
        tests/test_triton_prefill_a8_gpu.py -k tok 2>&1 | tee "$OUT/prefill_gpu_tests.txt" | tail -8
    timeout "$(left 480)" python benchmarks/bench_moe.py --shapes glm53flash_tp2 --tokens 4096 --baselines "" \
        --sweep prefill --prefill-tiles "$MID_TILES" --out "$OUT/mid" 2>&1 | tee "$OUT/bench_moe_mid.txt" \
        | grep -v "^{" | tail -8
    timeout "$(left 585)" python benchmarks/profile_decode.py --tokens 4096 --a4 --out "$OUT/kernels" \
        --prefill-tiles rs_w256_t128_d6_ws,rs_w256_t128_d6_ws_x2_h2 2>&1 | tee "$OUT/profile_decode.txt" \
        | tail -6
    ;;
small)
    timeout 585 python benchmarks/bench_moe.py --shapes glm53flash_tp2 --tokens 1024,2048,512 \
        --baselines "" --sweep prefill --prefill-tiles "$SMALL_GATHER" --out "$OUT/small" 2>&1 \
        | tee "$OUT/bench_moe_small.txt" | grep -v "^{" | tail -8
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
*)
    echo "usage: bash scripts/gpu_untimed_kernels.sh gather|mid|small|ncu (on a Hopper GPU, with OUT set)" >&2
    exit 2
    ;;
esac
