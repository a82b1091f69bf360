"""Graph passes: the split-prefill rewrite and its inspection with depyf."""

from a4prefill.passes.split_prefill import PassRecord, SplitPrefillPass, inductor_options

__all__ = ["PassRecord", "SplitPrefillPass", "inductor_options"]
