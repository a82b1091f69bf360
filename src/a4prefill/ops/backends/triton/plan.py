"""What one ``triton`` backend call launches (:class:`CallPlan`), from its shapes, io dtype and
device only: the tiles or the decode schedule (:mod:`schedules`), whether the device runs the
decode kernels and overlapping launches, how its routes are sorted (:mod:`routing`), the bf16
PTX dequantization and the split-K factors. Host arithmetic only, no host sync, no triton import
(the decode kernels' import is tried once, :func:`kernel_modules.decode_imports`).

Who may call: :func:`~a4prefill.ops.backends.triton.fused.fused_moe` (every call),
:mod:`warmup` (one call per distinct plan), :meth:`TritonBackend.kernel_family
<a4prefill.ops.backends.triton.backend.TritonBackend.kernel_family>`, tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from a4prefill.ops.backends.triton import kernel_modules
from a4prefill.ops.backends.triton.routing import RoutingLaunch, routing_launch
from a4prefill.ops.backends.triton.schedules import (
    DecodeTiles,
    GemmConfig,
    PrefillTiles,
    choose_config,
    choose_prefill_tiles,
)


def decode_kernels_run(device: torch.device) -> bool:
    """Whether :mod:`decode_kernels` can run on ``device``: an NVIDIA GPU with bf16 ``mma.sync``
    (sm_80+) and a Triton whose Gluon has what the kernels use (the module imports)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    return kernel_modules.decode_imports()


def prefill_kernels_run(device: torch.device) -> bool:
    """Whether :mod:`prefill_kernels` can run on ``device``: an sm_90 GPU (wgmma) and a Triton
    whose Gluon has what the kernels use (the module imports)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) == (9, 0) and kernel_modules.prefill_imports()


def grid_dependencies_run(device: torch.device) -> bool:
    """Whether ``device`` runs programmatic dependent launches (``griddepcontrol``, sm_90+): what
    ``DecodeTiles.overlap`` needs; elsewhere those schedules launch FC2 after FC1 as usual."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (9, 0)


def _split_k(k: int, block_k: int, wanted: int) -> int:
    split = wanted
    while split > 1 and k % (split * block_k):
        split //= 2
    return split


def _check_decode_call(schedule: DecodeTiles, hidden: int, intermediate: int, routes: int) -> None:
    """Reject a ``GemmConfig.decode`` the call's shapes cannot take (the kernels' int32 offsets
    need ``routes * max(hidden, intermediate) < 2**31``)."""
    if not schedule.fits(hidden, intermediate):
        raise ValueError(
            f"config.decode={schedule!r} does not split hidden={hidden} and intermediate={intermediate} "
            "evenly (DecodeGemm.fits: K by the warps' steps, the output rows by the CTAs' rows)"
        )
    if routes * max(hidden, intermediate) >= 2**31:
        raise ValueError(
            f"config.decode: {routes} routes x {max(hidden, intermediate)} columns exceed the decode "
            "kernels' int32 offsets; use the tiled kernels (decode=None) for calls this large"
        )


@dataclass(frozen=True)
class CallPlan:
    """What one :func:`~a4prefill.ops.backends.triton.fused.fused_moe` call launches, apart from its
    precision mode and its sizes: the tiles (``config``), whether the decode kernels run
    (``decode``: their schedule, else None and the tiled kernels run), whether the call runs the
    Hopper prefill GEMMs (``prefill``: their schedules, ``prefill_routing``: their route tiles; in
    every precision mode), how the routes are sorted,
    the bf16 PTX dequantization, the split-K factors of FC1 and FC2 and whether FC2 overlaps FC1.
    A function of the call's shapes, io dtype and device only (:func:`plan_call`): two calls with
    equal plans and modes compile and launch the same kernels, which is what
    :func:`a4prefill.ops.backends.triton.warmup.warm_up` relies on."""

    config: GemmConfig
    decode: DecodeTiles | None
    routing: RoutingLaunch
    ptx: bool
    split_k: tuple[int, int]
    overlap: bool
    prefill: PrefillTiles | None = None
    prefill_routing: RoutingLaunch | None = None


def plan_call(
    tokens: int,
    top_k: int,
    experts: int,
    hidden: int,
    intermediate: int,
    dtype: torch.dtype,
    device: torch.device,
    config: GemmConfig | None = None,
) -> CallPlan:
    """The :class:`CallPlan` of a call of ``tokens`` tokens (top-``top_k``) on a layer of
    ``experts`` experts (``hidden``, ``intermediate``) with ``dtype`` io on ``device`` (a CUDA
    device when the decode kernels may run). Without ``config``, the size's prefill GEMMs
    (:func:`choose_prefill_tiles`, where the prefill kernels run: bf16 io, sm_90) take the call
    first, then :func:`choose_config`'s decode schedule (where the decode kernels run), then its
    tiles. ``config`` overrides both choices: its ``decode`` schedule first, then its ``prefill``
    tiles where the prefill kernels run, else its tiles. Raises ``ValueError`` for a
    ``config.decode`` or ``config.prefill`` the shapes cannot take."""
    routes = tokens * top_k
    cfg = config or choose_config(routes, experts, hidden, intermediate)
    if cfg.decode is not None:
        _check_decode_call(cfg.decode, hidden, intermediate, routes)
    prefill_runs = dtype == torch.bfloat16 and prefill_kernels_run(device)
    # the size's own prefill tiles take a call before its decode schedule; an explicit config's
    # decode schedule comes first
    chosen_prefill = None
    if config is None and prefill_runs:
        chosen_prefill = choose_prefill_tiles(routes, experts, hidden, intermediate)
    decode = cfg.decode if cfg.decode is not None and dtype == torch.bfloat16 else None
    if decode is not None and chosen_prefill is None and decode_kernels_run(device):
        overlap = decode.overlap and grid_dependencies_run(device)
        return CallPlan(cfg, decode, routing_launch(routes, decode.routes), False, (1, 1), overlap)
    if cfg.prefill is not None and not cfg.prefill.fits(hidden, intermediate):
        raise ValueError(
            f"config.prefill={cfg.prefill} does not split hidden={hidden} and intermediate={intermediate} "
            "(PrefillTiles.fits: K by the steps, the output rows by the CTAs' weight rows)"
        )
    prefill = cfg.prefill if config is not None and prefill_runs else chosen_prefill
    # bf16 bit tricks need the bf16 exponent range; fp16 io uses the fp32 variant.
    ptx = cfg.ptx_dequant and dtype == torch.bfloat16
    split_k = (_split_k(hidden, cfg.fc1_k, cfg.split_k), _split_k(intermediate, cfg.fc2_k, cfg.split_k))
    prefill_routing = None if prefill is None else routing_launch(routes, prefill.routes)
    return CallPlan(
        cfg, None, routing_launch(routes, cfg.block_m), ptx, split_k, False, prefill, prefill_routing
    )
