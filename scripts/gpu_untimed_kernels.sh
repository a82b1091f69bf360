#!/usr/bin/env bash
# The Hopper device calls (H200 or H100) that check and time what rounds without a GPU built for
# issues 23 and 28 (the list as of the twenty-fourth round, the comparisons turned around in the
# twenty-fifth, which chose the _tok forms: the sweeps now time the forms that gather FC1's rows
# before the launch against the defaults; docs/prefill-kernel-next.md). One
# device call per mode, each under the tool's 600 s; everything is tee'd into $OUT, so a call cut
# off by its time limit keeps its output. No vLLM needed (no Marlin or Humming columns), except in
# the anchors mode.
#
#   bash scripts/gpu_untimed_kernels.sh verify # the twenty-sixth round's changes, first: the GPU
#                                              # tests of the prefill MoE (W4A16, A4, split: the
#                                              # _tok FC1's [T, K] permutation now gather_rows,
#                                              # whole rows first), of A8 (the _tok A8 defaults and
#                                              # the other weight placement's gathering forms) and
#                                              # the jit tests' cuda cases (prefill kernels, A8
#                                              # warm-up); then the whole MoE at 512-16384 tokens
#                                              # on the defaults with the two A8 defaults' columns
#                                              # (not yet run)
#   bash scripts/gpu_untimed_kernels.sh a4     # A4 and split at 4096 tokens on the 128-route
#                                              # tiles as one 8-warp partition (their default)
#                                              # and as two (W4A16's), after the twenty-sixth
#                                              # round's cheaper e2m1 rounding (not yet run)
#   bash scripts/gpu_untimed_kernels.sh anchors # issue 23's one-run table on the defaults with
#                                              # the Marlin and Humming columns (512-16384
#                                              # tokens); needs vLLM (../shared/gpu-vllm: its
#                                              # env.sh sourced) and humming-kernels 0.1.19's
#                                              # wheel in .whl (docs/humming.md, section 4;
#                                              # carry .whl); not yet run in this form
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
#   bash scripts/gpu_untimed_kernels.sh ncu    # Nsight Compute of the FC1 GEMM at 8192 tokens:
#                                              # the W4A16 default (rows copied by token) against
#                                              # its gathering form (why the copies cost the GEMMs
#                                              # 334 us), the A8 default, and at 4096 tokens
#                                              # W4A16 against A4 (A4's GEMMs took 17% longer in
#                                              # the twenty-fifth round); summarize the CSV
#                                              # here with profile_prefill.py --ncu-summary (the
#                                              # form with 1024, 2048, 16384 and a8_t256_rs took
#                                              # about 360 s)
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
NCU_CASES=(--case 8192:default:w4a16 --case "8192:$LARGE_GATHER:w4a16" --case 8192:default_a8
    --case 4096:default:w4a16 --case 4096:default:a4)
began=$(date +%s)
left() { echo $(($1 - ($(date +%s) - began))); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv | tee "$OUT/gpu.txt"
case "${1:-}" in
verify)
    timeout 330 python -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_triton_prefill_gpu.py \
        tests/test_triton_prefill_a8_gpu.py tests/test_triton_jit.py \
        -k "prefill_moe or a8 or every_prefill_kernel_reaches" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -8
    timeout "$(left 585)" python benchmarks/bench_moe.py --shapes glm53flash_tp2 \
        --tokens 512,1024,2048,4096,8192,16384 --baselines "" --a8-schedules a8_rs_tok,a8_t256_tok \
        --out "$OUT/defaults" 2>&1 | tee "$OUT/bench_moe_defaults.txt" | grep -v "^{" | tail -10
    ;;
a4)
    timeout 585 python benchmarks/bench_moe.py --shapes glm53flash_tp2 --tokens 4096 --baselines "" \
        --sweep prefill --prefill-tiles rs_w256_t128_d6_ws_x2_h2_tok,rs_w256_t128_d6_ws_tok \
        --a8-schedules a8_rs_tok --out "$OUT/a4" 2>&1 | tee "$OUT/bench_moe_a4.txt" | grep -v "^{" | tail -8
    ;;
anchors)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hsite \
        .whl/humming_kernels-0.1.19-*.whl || exit 1
    export PYTHONPATH=/tmp/hsite:$PYTHONPATH HUMMING_CACHE_DIR=/tmp/humming-cache
    timeout 585 python benchmarks/bench_moe.py --shapes glm53flash_tp2 \
        --tokens 512,1024,2048,4096,8192,16384 --baselines marlin,humming \
        --a8-schedules a8_rs_tok,a8_t256_tok --out "$OUT/anchors" 2>&1 | tee "$OUT/bench_moe_anchors.txt" \
        | grep -v "^{" | tail -12
    ;;
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
    echo "usage: bash scripts/gpu_untimed_kernels.sh verify|a4|anchors|gather|mid|small|ncu (on a Hopper GPU, with OUT set)" >&2
    exit 2
    ;;
esac
