"""a4prefill: NVFP4 MoE experts with W4A16 decode rows and A4 prefill rows.

``a4prefill.split_prefill_pass`` is the ready pass instance for
``-cc '{"inductor_passes": {"post_grad_custom_post_pass": "a4prefill.split_prefill_pass"}}'``.

This face imports the pass, and with it Inductor, on purpose: vLLM resolves that name as
``__import__("a4prefill").__dict__["split_prefill_pass"]`` while it builds its compilation config,
before it loads plugins (vLLM 0.26 to 0.34), so the instance must exist once the package is
imported. Python runs this face before any submodule, so importing any part of the package
imports Inductor too (about a second, once per process); the runtime modules themselves never
import the face (an import-linter contract), so the layering holds.
"""

from a4prefill import ops
from a4prefill.passes import SplitPrefillPass, inductor_options
from a4prefill.passes.split_prefill import split_prefill_pass

__all__ = ["SplitPrefillPass", "inductor_options", "ops", "split_prefill_pass"]
__version__ = "0.1.0"
