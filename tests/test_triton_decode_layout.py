"""The decode kernels' contracts that hold without a GPU: when the decode schedule is chosen,
what an explicit schedule must satisfy, and (compiled offline for sm_90a with Triton's bundled
ptxas) that the main loop streams weights straight into MMA registers. Their inline PTX runs in
``test_triton_decode_ptx.py``, their numerics in ``test_triton_decode_gpu.py``."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

from a4prefill.ops.backends.triton.schedules import (
    DECODE_MAX_ROWS_PER_EXPERT,
    DECODE_SCHEDULES,
    DecodeGemm,
    DecodeTiles,
    choose_config,
    choose_decode_tiles,
)
from helpers.markers import needs_gluon

GLM = {"experts": 288, "hidden": 4096, "intermediate": 1024}


@pytest.mark.parametrize("tokens", [1, 4, 16, 64, 256, 512, 1024])
def test_decode_sizes_of_the_glm_shape_get_a_decode_schedule(tokens):
    config = choose_config(tokens * 8, GLM["experts"], GLM["hidden"], GLM["intermediate"])
    assert isinstance(config.decode, DecodeTiles)
    assert config.decode.fits(GLM["hidden"], GLM["intermediate"])


@given(routes=st.integers(1, 1 << 16), rows_per_expert=st.floats(0.0, 64.0))
def test_the_schedule_table_covers_exactly_the_decode_sizes(routes, rows_per_expert):
    """Every call of up to ``DECODE_MAX_ROWS_PER_EXPERT`` routes per active expert gets a decode
    schedule from ``DECODE_SCHEDULES``, whatever its route count, and no larger call does."""
    tiles = choose_decode_tiles(routes, rows_per_expert)
    assert (tiles is not None) is (rows_per_expert <= DECODE_MAX_ROWS_PER_EXPERT)


@pytest.mark.parametrize("rule", DECODE_SCHEDULES, ids=lambda rule: rule.name)
def test_every_scheduled_decode_size_of_the_glm_shape_keeps_its_schedule(rule):
    """A schedule of the table that did not divide the shape it was chosen on would send those
    calls to the tiled kernels without a word."""
    assert rule.tiles.fits(GLM["hidden"], GLM["intermediate"])


@pytest.mark.parametrize(
    ("tokens", "hidden", "intermediate", "why"),
    [
        (2048, 4096, 1024, "57 routes per expert: the prefill tiles"),
        (8192, 4096, 1024, "prefill"),
        (4, 4096, 576, "576 is not a multiple of the 128-column K steps"),
        (4, 2000, 1024, "hidden not a multiple of the K split"),
    ],
)
def test_other_calls_keep_the_tiled_kernels(tokens, hidden, intermediate, why):
    assert choose_config(tokens * 8, GLM["experts"], hidden, intermediate).decode is None, why


@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_the_built_in_tiny_model_keeps_the_tiled_kernels(tokens):
    """The engine and CUDA-graph tests run the tiny model: its calls never reach the decode kernels."""
    from a4prefill.tools.tiny_model import TinyModelSpec

    spec = TinyModelSpec()
    config = choose_config(
        tokens * spec.top_k, spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    )
    assert config.decode is None


def _compile(
    kernel_name: str, gemm: DecodeGemm, routes: int, mode: int = 0, overlap: bool = False, dump: str = "-sass"
) -> str:
    """Compile a decode kernel with ``gemm``'s launch constexprs, ``routes``-route tiles,
    precision ``mode`` (``a4prefill.ops.precision.MODE_*``) and ``overlap`` (``DecodeTiles.overlap``) for
    sm_90a offline; returns what ``cuobjdump dump`` prints of it (SASS, or with
    ``-res-usage`` the registers per thread)."""
    import triton

    from a4prefill.ops.backends.triton import decode_kernels
    from a4prefill.ops.backends.triton.fused import _decode_launch_args
    from helpers.gluon_on_cpu import compile_sm90

    pointers = {
        "w_ptr": "*i32",
        "ws_ptr": "*u16",
        "w_scale2_ptr": "*fp32",
        "sorted_route_ptr": "*i32",
        "tile_expert_ptr": "*i32",
        "tile_row_ptr": "*i32",
        "seg_start_ptr": "*i32",
        "seg_count_ptr": "*i32",
        "num_tiles_ptr": "*i32",
    }
    constexprs = dict(_decode_launch_args(gemm, routes))
    warps = constexprs.pop("num_warps")
    maxnreg = constexprs.pop("maxnreg", None)
    a4 = {"gs2_ptr": "*fp32", "flag_ptr": "*u8"}
    if kernel_name == "fc1_decode_kernel":
        signature = {
            "x_ptr": "*bf16",
            "out_ptr": "*bf16",
            "gs1_ptr": "*fp32",
            "limit": "fp32",
            **a4,
            **pointers,
        }
        constexprs["HAS_LIMIT"] = False
    else:
        signature = {"h_ptr": "*bf16", "y_ptr": "*bf16", **a4, **pointers}
    signature.update({"H": "i32", "INTER": "i32", "TOPK": "i32", "ROUTES": "i32"})
    constexprs["MODE"] = mode
    constexprs["OVERLAP"] = overlap
    # what the launcher specializes: 16-byte aligned pointers, sizes divisible by 16
    divisible = {name for name, kind in signature.items() if kind.startswith("*") or name in ("H", "INTER")}
    kernel = getattr(decode_kernels, kernel_name)
    compiled = compile_sm90(kernel, signature, constexprs, warps, divisible, maxnreg)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run(
            [os.path.join(tools, "cuobjdump"), dump, cubin.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout


def _main_loop_opcodes(sass: str) -> collections.Counter[str]:
    """Opcode counts of the longest backward-branch loop of ``sass``."""
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    addresses = [int(re.match(r"\s+/\*([0-9a-f]{4})\*/", line).group(1), 16) for line in lines]  # type: ignore[union-attr]
    best: list[str] = []
    for address, line in zip(addresses, lines, strict=True):
        target = re.search(r"BRA\s+(?:`\(.*?\)\s*)?0x([0-9a-f]+)", line)
        if target and int(target.group(1), 16) < address:
            body = [
                x for a, x in zip(addresses, lines, strict=True) if int(target.group(1), 16) <= a <= address
            ]
            best = max(best, body, key=len)
    opcodes: collections.Counter[str] = collections.Counter()
    for line in best:
        match = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if match:
            opcodes[match.group(1)] += 1
    return opcodes


@pytest.mark.slow
@needs_gluon
@pytest.mark.parametrize(
    ("kernel_name", "gemm", "routes"),
    [
        ("fc1_decode_kernel", DecodeGemm(4, 128), 8),
        ("fc1_decode_kernel", DecodeGemm(2, 256), 8),
        ("fc1_decode_kernel", DecodeGemm(4, 256, "rows"), 8),
        ("fc1_decode_kernel", DecodeGemm(4, 128, "rows", 32), 8),
        ("fc1_decode_kernel", DecodeGemm(4, 128, "rows"), 16),
        ("fc1_decode_kernel", DecodeGemm(4, 128), 32),
        ("fc2_decode_kernel", DecodeGemm(2, 128), 8),
        ("fc2_decode_kernel", DecodeGemm(4, 128, "rows", 32), 8),
        ("fc2_decode_kernel", DecodeGemm(4, 128, "rows"), 16),
        ("fc2_decode_kernel", DecodeGemm(2, 128), 32),
        ("fc1_decode_kernel", DecodeGemm(4, 128, prefetch=True), 8),
        ("fc1_decode_kernel", DecodeGemm(4, 256, "rows", prefetch=True), 8),
        ("fc2_decode_kernel", DecodeGemm(4, 128, "rows", prefetch=True), 8),
    ],
    ids=str,
)
def test_the_main_loop_feeds_weights_from_global_memory_into_mma_registers(kernel_name, gemm, routes):
    """No shared memory, shuffle or barrier in the K loop, 128-bit code loads, and exactly the MMAs of
    one step: ``gemm.rows`` rows x block_k columns per operand by ``routes`` routes in m16n8k16
    pieces (gate and up in FC1), each code word loaded once whatever the route tile. The code
    words' right shifts stay on the ALU (``shr``, no ``IMAD.HI``: as ``mul.hi`` on the FMA pipe the
    kernels were 0.2-1.5% slower, benchmarks/results/README.md, forty-sixth round)."""
    opcodes = _main_loop_opcodes(_compile(kernel_name, gemm, routes))
    assert not {op for op in opcodes if op.startswith("IMAD.HI")}, opcodes
    operands = 2 if kernel_name.startswith("fc1") else 1
    steps = 2 if gemm.prefetch else 1  # a prefetching loop iteration takes two K steps
    m_tiles, n_tiles, k_steps = gemm.rows // 16, routes // 8, gemm.block_k // 16
    assert opcodes["HMMA.16816.F32.BF16"] == steps * operands * m_tiles * n_tiles * k_steps
    assert not {op for op in opcodes if op.startswith(("LDS", "STS", "LDSM", "BAR", "SHFL"))}
    # each thread: rows r + 8 i, 16 code bytes per row per 128 columns; 8 activations of each
    # 32 columns per 8 routes, already in MMA operand order
    weights = operands * (gemm.rows // 8) * (gemm.block_k // 128)
    activations = (gemm.block_k // 32) * (routes // 8)
    assert opcodes["LDG.E.128"] == steps * (weights + activations)
    assert not {op for op in opcodes if op.startswith("LDG.E.64")}


@pytest.mark.slow
@needs_gluon
@pytest.mark.parametrize(
    ("kernel_name", "gemm"),
    [
        ("fc1_decode_kernel", DecodeGemm(4, 256, "rows", stages=3)),
        ("fc1_decode_kernel", DecodeGemm(4, 128, stages=4)),
        ("fc2_decode_kernel", DecodeGemm(4, 128, "rows", stages=4)),
    ],
    ids=str,
)
def test_a_staged_main_loop_copies_the_code_words_through_shared_memory(kernel_name, gemm):
    """Each thread's 16-byte code chunks of a step go out as ``cp.async`` (LDGSTS.128) and come
    back as 128-bit shared loads; only the activations are loaded from global memory into
    registers (128 bits at a time)."""
    opcodes = _main_loop_opcodes(_compile(kernel_name, gemm, 8))
    operands = 2 if kernel_name.startswith("fc1") else 1
    chunks = operands * (gemm.rows // 8) * (gemm.block_k // 128)
    assert opcodes["LDGSTS.E.BYPASS.128"] == chunks
    assert opcodes["LDS.128"] == chunks
    assert opcodes["LDG.E.128"] == gemm.block_k // 32
    assert opcodes["DEPBAR.LE"] == 1  # one wait a step


@pytest.mark.slow
@needs_gluon
@pytest.mark.parametrize("mode", [0, 1, 2], ids=["w4a16", "a4", "split"])
def test_the_staged_fc1_of_3_to_64_tokens_fits_four_ctas_per_sm(mode):
    """The default FC1 of 3-64 tokens (GLM shape) keeps to 128 registers per thread in every
    precision: 4 CTAs of 128 threads per SM (65536 registers). Uncapped, the A4 and split
    epilogues need 134-136 and fit 3."""
    schedule = choose_decode_tiles(16 * 8, 128 / 105)
    assert schedule is not None and schedule.fc1.stages and schedule.fc1.warps == 4
    usage = _compile("fc1_decode_kernel", schedule.fc1, schedule.routes, mode, dump="-res-usage")
    (registers,) = {int(r) for r in re.findall(r"REG:(\d+)", usage)}
    assert registers <= 128


@pytest.mark.slow
@needs_gluon
def test_an_overlapping_fc2_waits_for_fc1_before_any_128_bit_load():
    """With ``overlap``, FC1 lets its dependents start first thing (PREEXIT before its first
    load) and FC2 asks L2 for its weights (CCTL.E.PF2) and waits for FC1 (ACQBULK) before it
    loads any activations or weights (the 128-bit loads; only the routing is read before)."""
    fc1, fc2 = DecodeGemm(4, 128, prefetch=True), DecodeGemm(4, 128, "rows", prefetch=True)

    def opcodes(sass: str) -> list[str]:
        return re.findall(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)

    first = opcodes(_compile("fc1_decode_kernel", fc1, 8, overlap=True))
    assert "PREEXIT" in first
    assert first.index("PREEXIT") < min(i for i, op in enumerate(first) if op.startswith("LDG"))
    second = opcodes(_compile("fc2_decode_kernel", fc2, 8, overlap=True))
    wait = second.index("ACQBULK")
    assert "CCTL.E.PF2" in second[:wait]
    assert not [op for op in second[:wait] if op.startswith("LDG.E.128")]
    plain = opcodes(_compile("fc2_decode_kernel", fc2, 8))
    assert "ACQBULK" not in plain and "CCTL.E.PF2" not in plain


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ((3, 128), "warps must be 1, 2, 4 or 8"),
        ((4, 384), "block_k must be 128, 256 or 512"),
        ((4, 128, "m"), "split must be 'k' or 'rows'"),
        ((4, 128, "k", 64), "rows must be 16 or 32"),
        ((4, 128, "k", 16, 1), "prefetch must be a bool"),
        ((4, 128, "k", 16, False, 5), "stages must be 0, 2, 3, 4 or 6"),
        ((4, 128, "k", 16, True, 3), "0 with prefetch"),
    ],
)
def test_a_schedule_the_kernels_cannot_run_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        DecodeGemm(*fields)


@pytest.mark.parametrize("routes", [4, 24, 64])
def test_a_route_tile_the_kernels_cannot_run_is_refused(routes):
    with pytest.raises(ValueError, match=r"DecodeTiles\.routes must be 8, 16 or 32"):
        DecodeTiles(DecodeGemm(4, 128), DecodeGemm(2, 128), routes)


@pytest.mark.parametrize(
    ("gemm", "k", "out_rows", "fits"),
    [
        (DecodeGemm(4, 128), 512, 16, True),
        (DecodeGemm(4, 128), 256, 16, False),  # 4 warps x 128 columns
        (DecodeGemm(4, 128, "rows"), 256, 64, True),  # each warp all of K
        (DecodeGemm(4, 128, "rows"), 256, 48, False),  # 4 warps x 16 rows per CTA
        (DecodeGemm(2, 256, "rows", 32), 512, 64, True),
        (DecodeGemm(2, 256, "rows", 32), 384, 64, False),
        (DecodeGemm(2, 128, "k", 32), 256, 96, True),
        (DecodeGemm(2, 128, "k", 32), 256, 80, False),
    ],
)
def test_a_gemm_schedule_fits_exactly_the_shapes_it_splits_evenly(gemm, k, out_rows, fits):
    assert gemm.fits(k, out_rows) is fits


def test_an_explicit_schedule_that_does_not_divide_the_shapes_is_refused():
    """Before any launch: the kernels would read past the rows' ends otherwise."""
    import torch

    from a4prefill.ops.backends.triton.fused import fused_moe
    from a4prefill.ops.backends.triton.schedules import GemmConfig
    from a4prefill.tools.tiny_layer import make_tiny_layer, random_routing

    layer = make_tiny_layer(4, 256, 128, 2, seed=0, calibrated=False)  # 256 % (4 * 128) != 0
    generator = torch.Generator().manual_seed(0)
    topk_weights, topk_ids = random_routing(3, 4, 2, generator)
    hidden = torch.randn(3, 256).to(torch.bfloat16)
    config = GemmConfig(
        16, 32, 128, 64, 128, 2, 4, decode=DecodeTiles(DecodeGemm(4, 128), DecodeGemm(2, 128))
    )
    with pytest.raises(ValueError, match=r"config.decode=.*hidden=256"):
        fused_moe(hidden, topk_weights, topk_ids, layer.experts, None, None, config=config)


PERMUTE_CHECK = """
import torch
from a4prefill.ops.backends.triton.decode_kernels import permute_k_kernel
from a4prefill.ops.backends.triton.decode_layouts import column_to_logical, logical_to_physical
hidden = 384
x = torch.arange(2 * hidden, dtype=torch.float32).reshape(2, hidden)
out = torch.empty_like(x)
permute_k_kernel[(2, 1)](x, out, hidden, BH=512)
index = torch.tensor(
    [128 * (c // 128) + logical_to_physical(column_to_logical(c % 128)) for c in range(hidden)]
)
assert torch.equal(out, x[:, index]), (out, x[:, index])
"""


@needs_gluon
def test_the_activation_permutation_kernel_applies_the_column_order():
    """``permute_k_kernel`` computes the relabelling inline; run it in Triton's CPU interpreter
    (which must be chosen before Triton builds the kernel, hence a subprocess)."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", PERMUTE_CHECK], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
