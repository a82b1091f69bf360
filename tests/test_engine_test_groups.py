"""The suite's own scheduling: the test files that start a vLLM engine run in the two groups of
``conftest.ENGINE_TEST_GROUPS``, and the files that compile the same kernels in those of
``conftest.SHARED_COMPILE_GROUPS``, one worker per group, when ``scripts/test.sh`` runs
pytest-xdist with ``--dist loadgroup``.

pytest-xdist reads the group from each item's ``xdist_group`` marker in its own
``pytest_collection_modifyitems`` and appends ``@<group>`` to the node id; items without the
suffix are scheduled one by one, so a module's engine fixtures (module-scoped, one engine start
each, 75-165 s on 2 cores) were started again on each worker and after every switch to another
module's test.
"""

from __future__ import annotations

import pytest

from conftest import ENGINE_TEST_GROUPS, XDIST_GROUPS


def test_every_grouped_test_carries_its_group_and_xdist_schedules_by_it(request: pytest.FixtureRequest):
    grouped = [item for item in request.session.items if item.path.name in XDIST_GROUPS]
    if not any(item.path.name in ENGINE_TEST_GROUPS for item in grouped):
        pytest.skip("needs an engine test file in the same run (the whole suite has them)")
    on_a_worker = hasattr(request.config, "workerinput")  # pytest-xdist sets loadgroup there
    loadgroup = on_a_worker and bool(request.config.getvalue("loadgroup"))
    for item in grouped:
        group = XDIST_GROUPS[item.path.name]
        markers = [marker.args for marker in item.iter_markers("xdist_group")]
        assert markers == [(group,)], item.nodeid
        if loadgroup:
            assert item.nodeid.endswith(f"@{group}"), f"{item.nodeid} is not in xdist's group {group}"
