"""``python -m a4prefill inspect``: dumps hold split nodes only for graphs beyond the limit."""

from __future__ import annotations

import pytest

from a4prefill.cli import main
from a4prefill.passes.inspect_graphs import inspect_model, parse_spec


def test_dump_shows_split_nodes_only_beyond_the_captured_limit(tmp_path):
    rows = {row.graph: row for row in inspect_model(tmp_path, ["8", "2:16", "40", "2:64"], captured_limit=16)}
    assert {g: (r.moe_nodes, r.rewritten) for g, r in rows.items()} == {
        "8": (2, 0),
        "2:16": (2, 0),
        "40": (2, 2),
        "2:64": (2, 2),
    }
    for graph in ("8", "2:16"):
        assert rows[graph].files_with_split_ops == []
        assert list(rows[graph].dump_dir.glob("*before_a4prefill_split_pass*.py"))
    for graph in ("40", "2:64"):
        names = rows[graph].files_with_split_ops
        assert any("after_a4prefill_split_pass" in n for n in names)
        assert not any("before_a4prefill_split_pass" in n for n in names)
        assert list(rows[graph].dump_dir.glob("__transformed_code_*.py"))


@pytest.mark.parametrize("spec", ["0", "1:8", "9:3", "a", "1:2:3"])
def test_bad_size_specs_are_rejected(spec):
    with pytest.raises(ValueError, match="size/range"):
        parse_spec(spec)


def test_cli_prints_the_table(tmp_path, capsys):
    assert main(["inspect", "--sizes", "40", "--captured-limit", "16", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rewritten" in out and "after_a4prefill_split_pass" in out
