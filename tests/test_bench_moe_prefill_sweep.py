"""The prefill-tile sweep of ``benchmarks/bench_moe.py`` (no GPU): which configs it times and how
its table reads a result."""

from __future__ import annotations

import pytest

from helpers.scripts import BENCHMARKS, load_benchmark


@pytest.fixture(scope="module")
def bench():
    with pytest.MonkeyPatch.context() as patch:  # bench_moe imports its sibling marlin_baseline
        patch.syspath_prepend(str(BENCHMARKS))
        return load_benchmark("bench_moe")


def test_the_sweep_times_every_tile_pair_the_shape_takes_in_place_of_the_default_kernels(bench):
    """GLM TP2 at 1024 tokens (a decode kernels' size off sm_90): one config per ``PREFILL_SWEEP`` pair,
    each with the decode schedule dropped and the pair's tiles set; a shape the 128-row CTAs do
    not divide (``2 * intermediate`` = 192) gets none."""
    from a4prefill.ops.backends.triton.schedules import choose_config

    default = choose_config(1024 * 8, 288, 4096, 1024)
    assert default.decode is not None
    configs = bench.prefill_configs(1024 * 8, 288, 4096, 1024)
    assert len(configs) == len(bench.PREFILL_SWEEP)
    for (fc1, fc2), (label, config) in zip(bench.PREFILL_SWEEP, configs.items(), strict=True):
        assert config.decode is None
        assert (config.prefill.fc1, config.prefill.fc2) == (bench.sweep_gemm(fc1), bench.sweep_gemm(fc2))
        assert label == f"prefill_fc1_{config.prefill.fc1}_fc2_{config.prefill.fc2}"
        assert (config.block_m, config.fc1_n, config.warps) == (default.block_m, default.fc1_n, default.warps)
    assert bench.prefill_configs(1024 * 8, 288, 4096, 96) == {}


def test_the_prefill_table_shows_each_pairs_w4a16_time_and_its_a4_and_split_ratios(bench):
    """One row per token count with a prefill sweep: the default W4A16 time, then per label (in
    sorted order) ``W4A16 (A4/W4A16 / split/W4A16)``, ``-`` for a mode not timed or a failed
    config; rows of other sweeps are left out."""
    results = {
        "shapes": {
            "s": {
                "shape": {},
                "rows": [
                    {
                        "tokens": 2048,
                        "w4a16_us": 2500.0,
                        "sweep_w4a16_us": {"prefill_b": 2000.0, "prefill_a": "RuntimeError('x')"},
                        "sweep_a4_us": {"prefill_b": 2100.0},
                        "sweep_split_us": {"prefill_b": 2300.0},
                    },
                    {"tokens": 512, "w4a16_us": 1000.0, "sweep_w4a16_us": {"decode_x": 900.0}},
                ],
            }
        }
    }
    table = bench.prefill_sweep_table(results).splitlines()
    assert table[2] == "| tokens | default W4A16 us | a | b |"
    assert table[4] == "| 2048 | 2500.0 | - | 2000.0 (1.05/1.15) |"
    assert len(table) == 5


def test_sweep_names_are_labels_or_warp_specialized_tiles_and_nothing_else(bench):
    """``ws[_w256]_t<routes>_d<depth>[_h2|_x2|_x2_h2][_c2|_c3][_tok][_la]``: the warp-specialized
    schedule of 128 (or 256) weight rows per work item with those tiles (two wgmmas per step, two A
    register sets, or both; two or three CTAs per SM; FC1's rows copied by token; loads ahead); a
    label stays its schedule; any other name is a ``ValueError`` naming the forms."""
    from a4prefill.ops.backends.triton.schedules import PREFILL_SCHEDULES, PrefillGemm

    assert bench.sweep_gemm("ws_t128_d8") == PrefillGemm(
        128, 128, depth=8, register_weights=True, warp_specialized=True
    )
    # _h2: two wgmmas per step; _x2_h2: and two A register sets (one wgmma in flight across steps)
    assert bench.sweep_gemm("ws_t256_d5_h2") == PrefillGemm(
        128, 256, depth=5, register_weights=True, wgmmas_per_step=2, warp_specialized=True
    )
    assert bench.sweep_gemm("ws_t128_d6_x2_h2") == PREFILL_SCHEDULES["rs_w128_t128_d6_ws_x2_h2"]
    # _x2: the next step's weights dequantized while the step's wgmma runs; _w256: 256-row items
    assert bench.sweep_gemm("ws_t128_d6_x2") == PREFILL_SCHEDULES["rs_w128_t128_d6_ws_x2"]
    assert bench.sweep_gemm("ws_w256_t128_d6") == PREFILL_SCHEDULES["rs_w256_t128_d6_ws"]
    assert bench.sweep_gemm("rs_w128_t32_d4") is PREFILL_SCHEDULES["rs_w128_t32_d4"]
    # _c2, _c3: CTAs sharing an SM
    assert bench.sweep_gemm("ws_t32_d6_c3") == PREFILL_SCHEDULES["rs_w128_t32_d6_ws_c3"]
    assert bench.sweep_gemm("ws_t64_d6_c2") == PREFILL_SCHEDULES["rs_w128_t64_d6_ws_c2"]
    assert bench.sweep_gemm("ws_w256_t32_d6_c2") == PREFILL_SCHEDULES["rs_w256_t32_d6_ws_c2"]
    assert bench.sweep_gemm("ws_w256_t128_d6_x2_h2") == PREFILL_SCHEDULES["rs_w256_t128_d6_ws_x2_h2"]
    assert bench.sweep_gemm("ws_t32_d6_x2_c2").ctas_per_sm == 2
    assert bench.sweep_gemm("ws_t32_d6_x2_c2").a_register_sets == 2
    # _tok, _la: rows copied by token, loads ahead (after the CTAs, in that order)
    assert bench.sweep_gemm("ws_w256_t32_d6_c2_tok_la") == PREFILL_SCHEDULES["rs_w256_t32_d6_ws_c2_tok_la"]
    assert bench.sweep_gemm("ws_w256_t128_d6_tok") == PREFILL_SCHEDULES["rs_w256_t128_d6_ws_tok"]
    c3_tok_la = bench.sweep_gemm("ws_t32_d6_c3_tok_la")
    assert (c3_tok_la.ctas_per_sm, c3_tok_la.rows_by_token, c3_tok_la.loads_ahead) == (3, True, True)
    assert not bench.sweep_gemm("ws_t32_d6_c3_la").rows_by_token
    for name in (
        "ws_t128",
        "ws_w128_t128_d6",
        "ws_t128_d6_h2_x2",
        "ws_t32_d6_c4",
        "ws_t32_d6_c2_x2",
        "ws_t32_d6_la_tok",
        "ws_t32_d6_tok_c3",
    ):
        with pytest.raises(ValueError, match=r"ws\[_w256\]_t<routes>_d<depth>.*\[_tok\]\[_la\]"):
            bench.sweep_gemm(name)


def test_prefill_tiles_given_on_the_command_line_replace_the_sweep_list(bench):
    """``--prefill-tiles ws_t32_d8,rs_w128_t64_d4:ws_t64_d6``: FC2 defaults to FC1's name; the
    configs are those pairs only, in that order; no option leaves :data:`PREFILL_SWEEP`."""
    pairs = bench.parse_prefill_tiles("ws_t32_d8,rs_w128_t64_d4:ws_t64_d6")
    assert pairs == [("ws_t32_d8", "ws_t32_d8"), ("rs_w128_t64_d4", "ws_t64_d6")]
    assert bench.parse_prefill_tiles(None) is None and bench.parse_prefill_tiles("") is None
    configs = bench.prefill_configs(1024 * 8, 288, 4096, 1024, pairs)
    assert [(c.prefill.fc1, c.prefill.fc2) for c in configs.values()] == [
        (bench.sweep_gemm(fc1), bench.sweep_gemm(fc2)) for fc1, fc2 in pairs
    ]
    assert configs["prefill_fc1_rs_w128_t32_k64_d8_ws_fc2_rs_w128_t32_k64_d8_ws"].prefill.fc1.routes == 32


def test_a8_schedules_are_timed_in_the_order_given_and_an_unknown_label_is_named(bench):
    """``--a8-schedules`` keeps the caller's order (so two runs in opposite orders show what the
    card's heating does to the later columns), defaults to every A8 schedule, and exits naming
    the argument and the label for one it does not know."""
    from a4prefill.ops.backends.triton.schedules import A8_SCHEDULES

    assert bench.parse_a8_schedules("a8_t256_tok,a8_rs") == ("a8_t256_tok", "a8_rs")
    assert bench.parse_a8_schedules(None) == bench.parse_a8_schedules("") == tuple(A8_SCHEDULES)
    with pytest.raises(SystemExit, match=r"--a8-schedules: unknown \['a8_wide'\]"):
        bench.parse_a8_schedules("a8_rs,a8_wide")


def test_reversed_columns_are_timed_last_to_first_and_the_default_order_is_as_built(bench):
    """``--reverse-columns`` times a size's columns last to first (``split`` before ``humming``
    before ``marlin`` ... before ``w4a16``); without it they run as built, W4A16 first. The order is
    what each JSON row records as ``column_order``."""
    variants = dict.fromkeys(["w4a16", "a4", "bf16", "a8_rs_tok", "marlin", "humming", "split"])
    assert bench.timing_order(variants, reverse=False) == list(variants)
    assert bench.timing_order(variants, reverse=True) == [
        "split",
        "humming",
        "marlin",
        "a8_rs_tok",
        "bf16",
        "a4",
        "w4a16",
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--baselines", "marlinn"],
            "--baselines: unknown ['marlinn']; expected some of ['marlin', 'humming']",
        ),
        (["--sweep-modes", "a4,spilt"], "--sweep-modes: unknown ['spilt']"),
        (["--shapes", "glm"], "--shapes: unknown ['glm']"),
        (["--sweep", "prefill", "--prefill-tiles", "ws_t32"], "--prefill-tiles: a PREFILL_SWEEP name is"),
        (["--prefill-tiles", "ws_t32_d6"], "--prefill-tiles names the tiles of --sweep prefill"),
        (["--tokens", "512,0"], "--tokens: expected token counts >= 1"),
    ],
)
def test_an_unknown_name_or_a_lone_option_is_refused_before_any_gpu_work(
    bench, monkeypatch, capsys, argv, message
):
    """Names the benchmark does not know were dropped before (a misspelt baseline's column just
    went missing) or failed after the first shapes had run."""
    monkeypatch.setattr("sys.argv", ["bench_moe.py", *argv])
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: pytest.fail("GPU work began"))
    with pytest.raises(SystemExit) as exited:
        bench.main()
    assert message in str(exited.value.code) + capsys.readouterr().err
