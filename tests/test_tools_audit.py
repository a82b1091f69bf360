"""The audit-log reader (``python -m a4prefill audit``, issue 27 point 1): it finds every break of
the rule in records written the way the engine's audit log writes them, and nothing else.

The writer itself runs in the engine tests (``test_vllm_e2e.py``: the split run and the TP=2 run
write their logs, and the reader checks them there).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from a4prefill.cli import main
from a4prefill.ops.fp8 import A8_READY
from a4prefill.ops.scales import A4_READY
from a4prefill.tools.audit import audit

CALIBRATED, PLAIN = "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"
STATUS = {CALIBRATED: A4_READY, PLAIN: "w13_input_scale has zero entries (not calibrated)"}


def step(number: int, rows: list[list[int]], layers: dict, mode: str = "NONE", rank: int = 0) -> dict:
    return {
        "kind": "step",
        "rank": rank,
        "step": number,
        "mode": mode,
        "tokens": -1,
        "rows": rows,
        "layers": layers,
        "counters": "host",
        "write_us": 12.5,
    }


def write(path: Path, *records: dict) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def kept_log(path: Path) -> Path:
    """A mixed step (3 prefill, 2 decode, 1 padding row), a decode-only step, a captured step."""
    return write(
        path,
        {"kind": "layers", "rank": 0, "status": STATUS},
        step(0, [[6, 3, 2, 1]], {CALIBRATED: {"w4a16": 3, "a4": 3}, PLAIN: {"w4a16": 6, "a4": 0}}),
        step(1, [[2, 0, 2, 0]], {CALIBRATED: {"w4a16": 2, "a4": 0}, PLAIN: {"w4a16": 2, "a4": 0}}),
        step(2, [], {CALIBRATED: {"w4a16": 4, "a4": 0}}, mode="FULL"),
    )


A8_STATUS = {CALIBRATED: A8_READY, PLAIN: "excluded by excluded_layers pattern 'layers\\.1\\.'"}


def a8_log(path: Path) -> Path:
    """The kept log's steps in an engine whose prefill precision is A8 (audit log keys: only the
    precisions that ran besides ``w4a16`` and ``a4``)."""
    return write(
        path,
        {"kind": "layers", "rank": 0, "status": A8_STATUS},
        step(0, [[6, 3, 2, 1]], {CALIBRATED: {"w4a16": 3, "a4": 0, "a8": 3}, PLAIN: {"w4a16": 6, "a4": 0}}),
        step(1, [[2, 0, 2, 0]], {CALIBRATED: {"w4a16": 2, "a4": 0}, PLAIN: {"w4a16": 2, "a4": 0}}),
        step(2, [], {CALIBRATED: {"w4a16": 4, "a4": 0}}, mode="FULL"),
    )


def test_an_a8_log_that_keeps_the_rule_is_summarized(tmp_path):
    report = audit([str(a8_log(tmp_path / "rows.rank0"))])
    assert report.violations == []
    assert (report.a8_rows, report.a4_rows, report.w4a16_rows) == (3, 0, 17)
    assert (report.a8_layers, report.a4_layers) == ({CALIBRATED}, set())
    assert "3 A8" in report.summary()


@pytest.mark.parametrize(
    ("record", "violation"),
    [
        (
            step(5, [], {CALIBRATED: {"w4a16": 3, "a4": 0, "a8": 1}}, mode="PIECEWISE"),
            "1 A8 rows in a captured",
        ),
        (
            step(5, [[6, 3, 2, 1]], {CALIBRATED: {"w4a16": 2, "a4": 0, "a8": 4}}),
            "4 A8 rows, only 3 prefill rows",
        ),
        (
            step(5, [[6, 3, 2, 1]], {CALIBRATED: {"w4a16": 4, "a4": 0, "a8": 2}}),
            "2 A8 rows of 3 prefill rows",
        ),
        (
            step(5, [[6, 3, 2, 1]], {CALIBRATED: {"w4a16": 3, "a4": 3}}),
            "3 A4 rows of 3 prefill rows (status: A8",
        ),
        (
            step(5, [[6, 3, 2, 1]], {PLAIN: {"w4a16": 5, "a4": 0, "a8": 1}}),
            "1 A8 rows of 3 prefill rows (status: ex",
        ),
        (step(5, [], {CALIBRATED: {"w4a16": 1, "a4": 0, "a8": 1}}), "A8 rows in a step with no row types"),
    ],
    ids=["captured", "decode_or_padding_a8", "partial", "a4_on_an_a8_layer", "excluded_a8", "untyped"],
)
def test_each_break_of_the_rule_by_a8_rows_is_named(tmp_path, record, violation):
    """Only the added step breaks the rule (A4 rows on an A8 layer also leave its A8 rows short:
    two lines for that step)."""
    path = a8_log(tmp_path / "rows.rank0")
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")
    report = audit([str(path)])
    assert report.violations and all(" step 5 " in line for line in report.violations), report.violations
    assert any(violation in line for line in report.violations), report.violations


def test_a_log_that_keeps_the_rule_is_summarized(tmp_path):
    report = audit([str(kept_log(tmp_path / "rows.rank0"))])
    assert report.violations == []
    assert (report.mixed_steps, report.decode_only_steps, report.captured_steps) == (1, 1, 1)
    assert (report.a4_rows, report.w4a16_rows, report.a4_layers) == (3, 17, {CALIBRATED})
    assert "rule: kept" in report.summary() and "median 12 us" in report.summary()


@pytest.mark.parametrize(
    ("record", "violation"),
    [
        (step(5, [], {CALIBRATED: {"w4a16": 3, "a4": 1}}, mode="PIECEWISE"), "1 A4 rows in a captured step"),
        (step(5, [[6, 3, 2, 1]], {CALIBRATED: {"w4a16": 2, "a4": 4}}), "4 A4 rows, only 3 prefill rows"),
        (step(5, [[6, 3, 2, 1]], {CALIBRATED: {"w4a16": 4, "a4": 2}}), "2 A4 rows of 3 prefill rows"),
        (step(5, [[6, 3, 2, 1]], {CALIBRATED: {"w4a16": 6, "a4": 0}}), "0 A4 rows of 3 prefill rows"),
        (step(5, [[6, 3, 2, 1]], {PLAIN: {"w4a16": 5, "a4": 1}}), "1 A4 rows of 3 prefill rows (status: w13"),
        (step(5, [], {CALIBRATED: {"w4a16": 1, "a4": 1}}), "A4 rows in a step with no row types"),
    ],
    ids=["captured", "decode_or_padding_a4", "partial", "calibrated_w4a16", "uncalibrated_a4", "untyped"],
)
def test_each_break_of_the_rule_is_named(tmp_path, record, violation):
    path = kept_log(tmp_path / "rows.rank0")
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")
    report = audit([str(path)])
    assert len(report.violations) == 1 and violation in report.violations[0], report.violations
    assert report.violations[0].startswith("rank 0 step 5 model.layers.")


def test_a_withdrawn_layer_is_checked_with_the_status_in_force(tmp_path):
    """After a refused reload the writer records the layer's new status; from then on the layer
    must run no A4 row, and A4 rows there are a violation."""
    withdrawn = {**STATUS, CALIBRATED: "A4 withdrawn by a refused reload: w2_input_scale has zero entries"}
    path = write(
        tmp_path / "rows.rank0",
        {"kind": "layers", "rank": 0, "status": STATUS},
        step(0, [[4, 4, 0, 0]], {CALIBRATED: {"w4a16": 0, "a4": 4}}),
        {"kind": "layers", "rank": 0, "status": withdrawn},
        step(1, [[4, 4, 0, 0]], {CALIBRATED: {"w4a16": 4, "a4": 0}}),
        step(2, [[4, 4, 0, 0]], {CALIBRATED: {"w4a16": 0, "a4": 4}}),
    )
    report = audit([str(path)])
    assert [v.split(":")[0] for v in report.violations] == [f"rank 0 step 2 {CALIBRATED}"]


@settings(max_examples=60, deadline=None)
@given(
    prefill=st.integers(0, 40),
    decode=st.integers(0, 40),
    padding=st.integers(0, 8),
    a4=st.integers(0, 88),
    calibrated=st.booleans(),
    captured=st.booleans(),
)
def test_any_counts_are_a_violation_exactly_when_the_rule_is_broken(
    tmp_path_factory, prefill, decode, padding, a4, calibrated, captured
):
    rows = prefill + decode + padding
    a4 = min(a4, rows)
    layer = CALIBRATED if calibrated else PLAIN
    record = step(
        0, [] if captured else [[rows, prefill, decode, padding]], {layer: {"w4a16": rows - a4, "a4": a4}}
    )
    record["mode"] = "FULL" if captured else "NONE"
    path = write(
        tmp_path_factory.mktemp("log") / "rows.rank0", {"kind": "layers", "rank": 0, "status": STATUS}, record
    )
    kept = a4 == 0 if captured or not calibrated else a4 == prefill
    assert (audit([str(path)]).violations == []) == kept


def test_the_setting_names_every_ranks_file_and_the_command_exits_1_on_a_violation(tmp_path, capsys):
    kept_log(tmp_path / "rows.rank0")
    write(
        tmp_path / "rows.rank1",
        step(0, [[2, 0, 2, 0]], {CALIBRATED: {"w4a16": 1, "a4": 1}}, rank=1),
    )
    assert main(["audit", str(tmp_path / "rows")]) == 1
    out = capsys.readouterr().out
    assert "audit of 2 file(s): steps rank 0: 3, rank 1: 1" in out
    assert "rank 1 step 0 model.layers.0.mlp.experts: 1 A4 rows, only 0 prefill rows" in out
    (tmp_path / "rows.rank1").unlink()
    assert main(["audit", str(tmp_path / "rows")]) == 0


def test_bad_input_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no audit log at"):
        audit([str(tmp_path / "missing")])
    (tmp_path / "broken").write_text('{"kind": "step"\n')
    with pytest.raises(ValueError, match="broken:1: not a JSON line"):
        audit([str(tmp_path / "broken")])
    (tmp_path / "odd").write_text('{"kind": "other"}\n')
    with pytest.raises(ValueError, match="odd:1: unknown record kind 'other'"):
        audit([str(tmp_path / "odd")])


def test_the_command_exits_2_naming_the_problem_when_nothing_can_be_checked(tmp_path, capsys):
    """A missing or malformed log, or one without any step record, is exit code 2 with the reason:
    never "rule: kept" and exit 0 for logs that showed nothing, never a traceback."""
    (tmp_path / "broken").write_text('{"kind": "step"\n')
    (tmp_path / "empty").write_text("")
    cases = {"missing": "no audit log at", "broken": "broken:1: not a JSON line", "empty": "no step record"}
    for name, reason in cases.items():
        assert main(["audit", str(tmp_path / name)]) == 2, name
        assert reason in capsys.readouterr().err, name
