"""a4prefill: NVFP4 MoE experts with W4A16 decode rows and A4 prefill rows.

``a4prefill.split_prefill_pass`` is the ready pass instance for
``-cc '{"inductor_passes": {"post_grad_custom_post_pass": "a4prefill.split_prefill_pass"}}'``.
"""

from a4prefill import ops
from a4prefill.passes import SplitPrefillPass, inductor_options
from a4prefill.passes.split_prefill import split_prefill_pass

__all__ = ["SplitPrefillPass", "inductor_options", "ops", "split_prefill_pass"]
__version__ = "0.1.0"
