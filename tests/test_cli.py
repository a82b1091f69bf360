"""``python -m a4prefill``: bad options are refused before anything runs, with exit code 2 and a
message naming the option and what it expects; defaults that apply only without another option
are filled after parsing."""

from __future__ import annotations

import pytest

from a4prefill import cli
from a4prefill.passes.split_prefill import DEFAULT_PASS

BAD = [
    (["demo", "--tokens", "0"], "--tokens: expected an integer >= 1, got 0"),
    (["demo", "--device", "gpu0"], "--device: expected a torch device"),
    (["e2e", "-cc", "{bad"], "--compilation-config/-cc: expected a JSON object"),
    (["e2e", "--additional-config", "[1]"], "--additional-config: expected a JSON object, got list"),
    (["e2e", "--model", "m", "--shape", "real"], "--shape picks a built-in model: not with --model"),
    (["e2e", "--no-pass", "--pass", "x.y"], "--pass names the split pass: not with --no-pass"),
    (["e2e", "-tp", "0"], "--tensor-parallel-size/-tp: expected an integer >= 1, got 0"),
    (["e2e", "-dp", "2"], "--data-parallel-size: data_parallel_size must be 1"),
    (["numerics", "--max-tokens-per-layer", "0"], "--max-tokens-per-layer: expected an integer >= 1"),
    (["numerics", "--exclude-factor", "0"], "--exclude-factor: expected a finite number > 0"),
    (
        ["numerics", "--gpu-memory-utilization", "1.5"],
        "--gpu-memory-utilization: expected a number in (0, 1]",
    ),
    (["inspect", "--sizes", "8,bad"], "--sizes: size/range 'bad' must be N or LO:HI"),
    (["inspect", "--captured-limit", "-1"], "--captured-limit: expected an integer >= 0"),
    (["inspect", "--model", "m", "--sizes", "8"], "--sizes and --captured-limit are the built-in model's"),
    (["b12x-compile", "--shape", "tiny,bogus"], "--shape: expected a comma list of ['glm-tp2', 'tiny']"),
    (["b12x-compile", "--arch", "sm_90a"], "--arch: expected a comma list of ['sm_120a', 'sm_121a']"),
    (["b12x-compile", "--max-tokens", "0"], "--max-tokens: expected an integer >= 1"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(argv) for argv, _ in BAD])
def test_a_bad_option_exits_2_naming_it_before_anything_runs(argv, message, capsys, monkeypatch):
    def ran(args):
        raise AssertionError(f"the command ran with {args}")

    for name in ("_demo", "_e2e", "_numerics", "_inspect", "_b12x_compile"):
        monkeypatch.setattr(cli, name, ran)
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def checked(argv: list[str]):
    args = cli.build_parser().parse_args(argv)
    cli._check_combinations(args)
    return args


def test_defaults_that_depend_on_other_options_are_filled_after_parsing():
    e2e = checked(["e2e", "-cc", '{"mode": 3}'])
    assert (e2e.shape, e2e.split_pass, e2e.compilation_config) == ("tiny", DEFAULT_PASS, {"mode": 3})
    assert checked(["e2e", "--no-pass"]).split_pass is None
    inspect = checked(["inspect"])
    assert (inspect.sizes, inspect.captured_limit) == (
        cli.DEFAULT_SIZES.split(","),
        cli.DEFAULT_CAPTURED_LIMIT,
    )
    assert checked(["inspect", "--sizes", "40,2:64", "--captured-limit", "0"]).sizes == ["40", "2:64"]
    assert checked(["b12x-compile", "--shape", "tiny"]).shape == ["tiny"]
