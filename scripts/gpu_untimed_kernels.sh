#!/usr/bin/env bash
# The Hopper device calls (H200 or H100) that check and time what rounds without a GPU, or
# without enough of it, built for issues 23 and 28 (the list as of the thirty-first round;
# docs/prefill-kernel-next.md). One device call per mode, each under the tool's 600 s;
# everything is tee'd into $OUT, so a call cut off by its time limit keeps its output. The modes
# of earlier rounds (verify, a4, gather, mid, small: the twenty-third to twenty-eighth rounds;
# pending and permute: the thirty-ninth; halves, ahead, fence, quant, tiles: the twenty-ninth
# to thirty-third; sectors: the forty-second; ss: the forty-third; ss4: the forty-fourth;
# benchmarks/results/README.md) are in this file's history (git log -p on it).
#
#   bash scripts/gpu_untimed_kernels.sh ab DIR...  # this checkout's defaults against the
#                                               # src trees DIR... (other commits' src, carried
#                                               # under .scratch/): the GPU tests selected by
#                                               # AB_TESTS (-k; default the loads-ahead
#                                               # schedules, within AB_TEST_SECONDS, 150), then
#                                               # the whole MoE at AB_SIZES tokens (512, 1024,
#                                               # 4096) on src, each DIR, then again; last each
#                                               # tree's GPU kernels of one W4A16 call at
#                                               # AB_PROFILE_SIZES tokens (4096)
#   bash scripts/gpu_untimed_kernels.sh window  # one short window (WINDOW_SECONDS, default
#                                               # 585) on whichever Hopper card came: the sizes
#                                               # mode's Nsight Compute (within all but 240 s),
#                                               # then the rivals mode's (Marlin only where vLLM's
#                                               # env.sh was sourced; carry .whl)
#   bash scripts/gpu_untimed_kernels.sh rivals  # Nsight Compute of the package's, Marlin's and
#                                               # Humming's GEMMs of one W4A16 MoE call at
#                                               # RIVAL_SIZES tokens (512,1024,2048: where
#                                               # Humming is faster or close), with the executed
#                                               # instructions (InstructionStats), into
#                                               # $OUT/ncu_rivals.csv; needs humming-kernels'
#                                               # wheel in .whl, and for Marlin vLLM's env.sh
#   bash scripts/gpu_untimed_kernels.sh t64     # the 64-route tiles of 256 weight rows, one
#                                               # CTA per SM, with loads ahead, without and with
#                                               # scale sectors (_tok_la: thirty-sixth round,
#                                               # timed in the thirty-ninth; _tok_la_ss:
#                                               # forty-seventh, built without a GPU): the
#                                               # latter's GEMM and A4/split MoE GPU tests, then
#                                               # the whole MoE at 1536 and 2048 tokens (W4A16,
#                                               # A4, split) beside the default's 128-row two-CTA
#                                               # tiles, then again in the opposite order
#   bash scripts/gpu_untimed_kernels.sh q4      # A8's 256-route register-weights tiles with
#                                               # the route quarters (a8_t256_rs_tok_q4,
#                                               # forty-eighth round, built without a GPU): its
#                                               # A8 GPU tests, then the whole MoE at 4096,
#                                               # 8192 and 16384 tokens with the A8 default's
#                                               # 256-route column (a8_t256_tok) beside it,
#                                               # then again with the columns last to first
#   bash scripts/gpu_untimed_kernels.sh waves   # how the 32-route GEMMs' time follows their
#                                               # work items per SM (the last wave): FC1 and
#                                               # FC2 alone (bench_prefill_gemm.py --experts)
#                                               # at 512 and 1024 tokens over 256-312 experts,
#                                               # the 256-row two-CTA default against the
#                                               # 128-row three-CTA _tok_la tiles, up then down
#   bash scripts/gpu_untimed_kernels.sh sizes   # Nsight Compute of every GEMM of one W4A16 MoE
#                                               # call at 512-16384 tokens (profile_decode.py
#                                               # --ncu; summarize the CSV here with
#                                               # profile_decode.py --ncu-summary)
#   bash scripts/gpu_untimed_kernels.sh anchors # issue 23's one-run table on the defaults with
#                                               # the Marlin and Humming columns (512-16384
#                                               # tokens), then the same with the columns timed
#                                               # last to first (--reverse-columns), then the
#                                               # time per kernel of W4A16, A4, A8, Marlin
#                                               # and Humming there; needs vLLM
#                                               # (../shared/gpu-vllm: its env.sh sourced) and
#                                               # humming-kernels 0.1.19's wheel in .whl
#                                               # (docs/humming.md, section 4; carry .whl)
#   bash scripts/gpu_untimed_kernels.sh ncu     # Nsight Compute of the FC1 GEMM at 8192 tokens:
#                                               # the W4A16 default (rows copied by token) against
#                                               # its gathering form, the A8 default, and at 4096
#                                               # tokens W4A16 against A4 (twenty-eighth round);
#                                               # summarize the CSV here with profile_prefill.py
#                                               # --ncu-summary
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder the results go to (the device tool sets it)}"
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
LARGE_GATHER=rs_w128_t256_d4_ws_x2_h2
SIZES=512,1024,2048,4096,8192,16384
NCU_CASES=(--case 8192:default:w4a16 --case "8192:$LARGE_GATHER:w4a16" --case 8192:default_a8
    --case 4096:default:w4a16 --case 4096:default:a4)
began=$(date +%s)
# seconds left of $1 since the start, at least 1 (timeout takes 0 as "no limit")
left() { local l=$(($1 - ($(date +%s) - began))); echo $((l > 1 ? l : 1)); }
# the whole MoE at 1536 and 2048 tokens (W4A16, A4, split) with the prefill tiles $2 (comma list,
# timed in that order) swept beside the defaults, into $OUT/t64_$3, within $1 seconds of the start
time_t64() {
    timeout "$(left "$1")" python benchmarks/bench_moe.py --shapes glm53flash_tp2 --tokens 1536,2048 \
        --baselines "" --a8-schedules a8_rs_tok --sweep prefill --sweep-modes a4,split \
        --prefill-tiles "$2" --out "$OUT/t64_$3" 2>&1 | tee "$OUT/bench_moe_t64_$3.txt" \
        | grep -o '"sweep_w4a16_us": {[^}]*}' || tail -4 "$OUT/bench_moe_t64_$3.txt"
}
T64_LA=rs_w256_t64_d6_ws_tok_la T64_LA_SS=rs_w256_t64_d6_ws_tok_la_ss
# the Nsight Compute sections of every profile here (summaries: profile_decode.py or
# profile_prefill.py --ncu-summary)
NCU_SECTIONS=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats)
# Nsight Compute of every GEMM of one W4A16 MoE call at $SIZES tokens, within $1 seconds of the
# start (at most 420), into $OUT/ncu_sizes.csv
profile_sizes() {
    local budget=$(($1 < 420 ? $1 : 420))
    timeout "$(left "$budget")" ncu --profile-from-start off "${NCU_SECTIONS[@]}" --csv \
        python benchmarks/profile_decode.py --ncu --tokens "$SIZES" --out "$OUT/ncu" >"$OUT/ncu_sizes.csv" \
        2>"$OUT/ncu_sizes.err"
    tail -3 "$OUT/ncu_sizes.err"
}
# humming-kernels 0.1.19 from .whl into /tmp/hsite, on PYTHONPATH (docs/humming.md, section 4)
install_humming() {
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hsite \
        .whl/humming_kernels-0.1.19-*.whl || exit 1
    export PYTHONPATH=/tmp/hsite:$PYTHONPATH HUMMING_CACHE_DIR=/tmp/humming-cache
}
# Nsight Compute of the package's, Marlin's (where vLLM imports) and Humming's MoE GEMMs at
# RIVAL_SIZES tokens, within $1 seconds of the start, into $OUT/ncu_rivals.csv
profile_rivals() {
    install_humming
    timeout "$(left "$1")" ncu --profile-from-start off "${NCU_SECTIONS[@]}" --section InstructionStats \
        --csv python benchmarks/profile_decode.py --ncu --humming --tokens "${RIVAL_SIZES:-512,1024,2048}" \
        --out "$OUT/ncu" >"$OUT/ncu_rivals.csv" 2>"$OUT/ncu_rivals.err"
    tail -3 "$OUT/ncu_rivals.err"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv | tee "$OUT/gpu.txt"
case "${1:-}" in
ab)
    # the GPU tests of what the trees change (-k, default: the loads-ahead schedules) on this
    # checkout, then the whole MoE at 512-4096 tokens on src and each tree in turn, twice
    shift
    tests=${AB_TESTS:-tok_la or tok_h2_la}
    timeout "${AB_TEST_SECONDS:-150}" python -m pytest -q -p no:cacheprovider -rs -m gpu \
        tests/test_triton_prefill_gpu.py tests/test_triton_prefill_a8_gpu.py -k "$tests" --durations=5 2>&1 \
        | tee "$OUT/gpu_tests.txt" | tail -4
    # one file per run comes back (the device tool returns a few files a call): the JSON, no plot
    for tree in src "$@" src "$@"; do
        n=$((${n:-0} + 1))
        echo "## run $n: PYTHONPATH=$tree" >>"$OUT/ab.txt"
        PYTHONPATH=$tree timeout "$(left 585)" python benchmarks/bench_moe.py --shapes glm53flash_tp2 \
            --tokens "${AB_SIZES:-512,1024,4096}" --baselines "" --a8-schedules a8_rs_tok --out "$OUT/ab_$n" 2>&1 \
            | tee -a "$OUT/ab.txt" | grep -o '"tokens": [0-9]*\|"w4a16_us": [0-9.]*\|"a4_us": [0-9.]*' \
            | paste -sd ' ' | sed "s|^|$tree: |"
        rm -f "$OUT/ab_$n/bench_moe.png"
    done
    # where each tree's time goes at AB_PROFILE_SIZES tokens (default 4096): every GPU kernel of
    # one W4A16 call (torch.profiler, benchmarks/profile_decode.py: the gather, FC1, FC2, combine)
    for tree in src "$@"; do
        n=$((n + 1))
        echo "## profile $n: PYTHONPATH=$tree" >>"$OUT/ab.txt"
        PYTHONPATH=$tree timeout "$(left 585)" python benchmarks/profile_decode.py \
            --tokens "${AB_PROFILE_SIZES:-4096}" --out "$OUT/ab_$n" 2>&1 | tee -a "$OUT/ab.txt" \
            | grep "tokens=" | sed "s|^|$tree: |"
    done
    ;;
window)
    budget=${WINDOW_SECONDS:-585}
    profile_sizes "$((budget - 240))"
    profile_rivals "$budget"
    ;;
rivals)
    profile_rivals 585
    ;;
q4)
    timeout 150 python -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_triton_prefill_a8_gpu.py \
        -k "a8_t256_rs_tok_q4 or route_quarters" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -4
    for order in "" --reverse-columns; do
        timeout "$(left 585)" python benchmarks/bench_moe.py --shapes glm53flash_tp2 --tokens 4096,8192,16384 \
            --baselines "" --a8-schedules a8_t256_tok,a8_t256_rs_tok_q4 $order --out "$OUT/q4${order:+_reversed}" \
            2>&1 | tee -a "$OUT/bench_moe_q4.txt" | grep -o '"tokens": [0-9]*\|"a8_t256[a-z0-9_]*_us": [0-9.]*' \
            | paste -sd ' '
    done
    rm -f "$OUT/q4_reversed/bench_moe.png"
    ;;
waves)
    experts="256 264 272 280 288 296 304 312"
    for order in "$experts" "$(echo $experts | tr ' ' '\n' | tac | paste -sd ' ')"; do
        n=$((${n:-0} + 1))
        timeout "$(left 585)" python benchmarks/bench_prefill_gemm.py --out "$OUT/waves_$n" --tokens 512 1024 \
            --experts $order --no-grouped-mm --schedules rs_w256_t32_d6_ws_c2_tok_la ws_t32_d6_c3_tok_la 2>&1 \
            | tee "$OUT/waves_$n.txt" | tail -2
        rm -f "$OUT/waves_$n/bench_prefill_gemm.png"
    done
    ;;
t64)
    timeout 200 python -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_triton_prefill_gpu.py \
        -k "$T64_LA_SS" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -4
    time_t64 585 "$T64_LA_SS,$T64_LA" 1
    time_t64 585 "$T64_LA,$T64_LA_SS" 2
    ;;
sizes)
    profile_sizes 420
    ;;
anchors)
    install_humming
    # the columns as built (W4A16 first), then last to first (--reverse-columns: Marlin and
    # Humming before the package's on a cooler card); no plot of the second (few files return)
    for order in "" --reverse-columns; do
        timeout "$(left 480)" python benchmarks/bench_moe.py --shapes glm53flash_tp2 --tokens "$SIZES" \
            --baselines marlin,humming --a8-schedules a8_rs_tok,a8_t256_tok $order \
            --out "$OUT/anchors${order:+_reversed}" 2>&1 | tee -a "$OUT/bench_moe_anchors.txt" \
            | grep -o '"tokens": [0-9]*\|"w4a16_speedup_vs_[a-z]*": [0-9.]*' | paste -sd ' '
    done
    rm -f "$OUT/anchors_reversed/bench_moe.png"
    timeout "$(left 585)" python benchmarks/profile_decode.py --tokens "$SIZES" --a4 --a8 --humming \
        --out "$OUT/kernels" 2>&1 | tee "$OUT/profile_decode.txt" | tail -4
    ;;
ncu)
    timeout 585 ncu --profile-from-start off -k regex:grouped_w4 "${NCU_SECTIONS[@]}" --page details --csv \
        python benchmarks/profile_prefill.py "${NCU_CASES[@]}" >"$OUT/ncu.csv" \
        2>"$OUT/ncu.err"
    tail -5 "$OUT/ncu.err"
    echo "then here: python benchmarks/profile_prefill.py ${NCU_CASES[*]} --ncu-summary ncu.csv --out DIR"
    ;;
*)
    echo "usage: bash scripts/gpu_untimed_kernels.sh ab DIR...|window|rivals|t64|q4|waves|sizes|anchors|ncu (on a Hopper GPU, with OUT set)" >&2
    exit 2
    ;;
esac
