"""Inline PTX of the ``triton`` backend's decode kernels (Gluon: imported lazily, with
:mod:`decode_kernels`): the asm strings and the ``gluon.jit`` functions that run them.

- :data:`CODES_ASM` (:data:`WORD_CODES_ASM`: its eight-output form), with the scale pairs'
  factors of :data:`numerics.SCALE_PAIR_FACTORS_ASM`: e4m3 scale bytes and e2m1 code bytes to the
  exact bf16 weights ``e2m1 * scale * 2**-7`` (:func:`_factors`, :func:`_dequant_words`);
  ``tests/helpers/ptx_subset.py`` runs them bit for bit on the CPU;
- :data:`L2_PREFETCH_ASM` (:func:`_l2_prefetch_rows`), :data:`LAUNCH_DEPENDENTS_ASM` and
  :data:`WAIT_FOR_PREREQUISITES_ASM` (:func:`_grid_dependency`): FC2 overlapping FC1
  (``DecodeTiles.overlap``, sm_90+).

The tiled kernels' inline PTX (bf16 dequantization) is in :mod:`numerics`, which imports without
Gluon.

Who may call: :mod:`decode_kernels`, tests.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from a4prefill.ops.backends.triton.numerics import SCALE_PAIR_FACTORS_ASM, word_pair_dequant_lines

# $4: four code bytes (eight e2m1 nibbles n0..n7, n0 in bits 0..3). $5: the bf16 factor of
# their block (:data:`numerics.SCALE_PAIR_FACTORS_ASM`), used in both halves (``mov.b32 f, {$5,
# $5}`` costs nothing: ptxas reads the factor's half through the multiply's operand swizzle).
# $0, $1: half s=0, elements (n0, n4), (n1, n5); $2, $3: half s=1, (n2, n6), (n3, n7)
# (:func:`numerics.word_pair_dequant_lines`: each bf16 ``e2m1 * scale * 2**-7``, exact).
CODES_ASM = gl.constexpr(
    "\n{\n.reg .b32 m, s, f, nz;\nmov.b32 nz, 0x80008000;\nmov.b32 f, {$5, $5};\n"
    + word_pair_dequant_lines("f")
    + "}\n"
)


@gluon.jit
def _factors(scale_pairs, WORDS: gl.constexpr):
    """Scale byte pairs ``[W, M, G / 2]`` (uint16, :func:`scale_layout`) -> the
    :data:`numerics.SCALE_PAIR_FACTORS_ASM` factors (bf16) of the ``G`` bytes, each repeated for
    its block's 2 code words: ``[W, M, 2 G]`` in the ``WORDS`` layout (register copies only)."""
    shape: gl.constexpr = scale_pairs.shape
    low, high = gl.inline_asm_elementwise(
        SCALE_PAIR_FACTORS_ASM,
        "=h,=h,r",
        [scale_pairs.to(gl.int32)],
        dtype=(gl.bfloat16, gl.bfloat16),
        is_pure=True,
        pack=1,
    )
    f = gl.reshape(gl.join(low, high), [shape[0], shape[1], shape[2] * 2])
    f = gl.reshape(gl.join(f, f), [shape[0], shape[1], shape[2] * 4])
    return gl.convert_layout(f, WORDS)


def _split_outputs(asm: str) -> str:
    """:data:`CODES_ASM` with its four bf16x2 results split into eight bf16 outputs ``$0..$7``
    (``$2 i`` the low half of result ``i``) and its inputs renumbered to ``$8`` (word), ``$9``."""
    body = asm.strip().removeprefix("{").removesuffix("}")
    for i in range(4):
        body = body.replace(f"${i},", f"o{i},")
    body = body.replace("$4", "$8").replace("$5", "$9")
    splits = "".join(f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, o{i};\n" for i in range(4))
    return "{\n.reg .b32 o0, o1, o2, o3;" + body + splits + "}"


WORD_CODES_ASM = gl.constexpr(_split_outputs(CODES_ASM.value))


@gluon.jit
def _dequant_words(words, factors):
    """Code words (int32, 4 code bytes each) and their factors (same shape and layout) -> the
    halves ``(s=0, s=1)`` of :func:`_dequant`, ``[..., 4 n]`` bf16 (byte ``4 J + p`` of word ``J``
    at ``4 J + p``)."""
    outs = gl.inline_asm_elementwise(
        WORD_CODES_ASM,
        "=h,=h,=h,=h,=h,=h,=h,=h,r,h",
        [words, factors],
        dtype=(gl.bfloat16,) * 8,
        is_pure=True,
        pack=1,
    )
    shape: gl.constexpr = words.shape
    low = gl.join(gl.join(outs[0], outs[2]), gl.join(outs[1], outs[3]))
    high = gl.join(gl.join(outs[4], outs[6]), gl.join(outs[5], outs[7]))
    low = gl.reshape(low, [shape[0], shape[1], shape[2] * 4])
    high = gl.reshape(high, [shape[0], shape[1], shape[2] * 4])
    return low, high


# $1: a global address; L2 fetches the 128-byte line that holds it (``prefetch.global.L2``: no
# register waits for it, there is nothing to wait for). $0: a dummy result (inline asm needs one).
L2_PREFETCH_ASM = gl.constexpr("{ prefetch.global.L2 [$1]; mov.b32 $0, 0; }")
# Programmatic dependent launch (sm_90+): FC1's CTAs let FC2's start at once (FC2's CTAs then
# fill the SMs FC1's last wave leaves idle); FC2 waits for FC1's grid to finish and its memory to
# be visible before it reads FC1's output. Without a dependent launch both return at once.
LAUNCH_DEPENDENTS_ASM = gl.constexpr("{ griddepcontrol.launch_dependents; mov.b32 $0, 0; }")
WAIT_FOR_PREREQUISITES_ASM = gl.constexpr("{ griddepcontrol.wait; mov.b32 $0, 0; }")


@gluon.jit
def _grid_dependency(ASM: gl.constexpr):
    """One ``griddepcontrol`` instruction (:data:`LAUNCH_DEPENDENTS_ASM` or
    :data:`WAIT_FOR_PREREQUISITES_ASM`), once per thread."""
    gl.inline_asm_elementwise(ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _l2_prefetch_rows(w_base, line_off, steps, BK: gl.constexpr):
    """Asks L2 for every code word of a warp's rows over its ``steps`` K steps (``line_off`` the
    first word of each 128-byte line of step 0, :func:`l2_prefetch_layout`; a 128-column step
    shares its line with the next one, so those go two steps at a time)."""
    STRIDE: gl.constexpr = 2 if BK == 128 else 1
    for step in range(0, steps, STRIDE):
        gl.inline_asm_elementwise(
            L2_PREFETCH_ASM,
            "=r,l",
            [w_base + line_off + step * (BK // 8)],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )
