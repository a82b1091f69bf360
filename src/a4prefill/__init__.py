"""a4prefill: NVFP4 MoE experts with W4A16 decode rows and A4 prefill rows."""

from a4prefill import ops

__all__ = ["ops"]
__version__ = "0.1.0"
