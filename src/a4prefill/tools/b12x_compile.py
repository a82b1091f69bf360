"""Compile the b12x backend's kernels for SM120 or SM121 on a machine without that GPU (a tool).

On an SM120/SM121 GPU, :meth:`B12xBackend.prepare_layer
<a4prefill.ops.backends.b12x_moe.B12xBackend.prepare_layer>` translates a layer
(:mod:`~a4prefill.ops.backends.b12x_weights`), prepares the ``w4a16`` plan and, for a calibrated
layer, the ``a4`` plan (:mod:`~a4prefill.ops.backends.b12x_plans`), and has b12x's
``prepare_default`` compile each plan's execution declaration: for every variant of the
declaration, the compile jobs of b12x's default configuration for that device. This module builds
the same plans with the same package functions on the CPU and compiles the same jobs through
b12x's own compile pool, whose spawned workers fake the device (compute capability, SM count,
shared memory) and compile CuTe DSL objects and Triton cubins for it (``sm_120a``: RTX PRO 6000;
``sm_121a``: DGX Spark). Preparation compiles a superset of what ``bind``/``run`` launch (b12x also
compiles its expert-map and route variants), and nothing is launched here.

Each compiled program is then read back: a CuTe object is a host ELF whose device code is an
embedded CUDA ELF; Triton's ``cuobjdump`` (bundled with Triton) reports that image's target
(``sm=120a``) and kernels. Triton programs are read from Triton's cache.

The objects land in b12x's and Triton's disk caches (``B12X_COMPILE_CACHE_DIR``,
``TRITON_CACHE_DIR``). b12x keys its cache on the toolchain too (torch build, CUDA version,
package fingerprint), so a cache filled with a CPU build of torch is not one a GPU process reads.

b12x internals this relies on (b12x 1.5.1; ``tests/test_b12x_compile.py`` pins them):
``b12x._lib.compile_pool.{CompilePool, describe_compilation, _initialize_worker,
_offline_compiler_spawn_environment}``, ``b12x._lib.compiler._cache_object_path``,
``b12x._lib.utils._num_sm_cache``, ``b12x.preparation.device.DetectedDevice``,
``b12x.preparation.types.DeviceIdentity``, and on a declaration: ``variants`` (several token
counts) or a single plan, ``plan.contract.configure(query, device=, override=, search=False)``
with ``.pinned``/``.default``, ``plan._compile_jobs(config, device)``, ``plan.query``,
``plan.override``. The W4A16 weight preparation asks ``torch.cuda.get_device_properties`` for the
SM count (workspace sizing): answered for the target while it runs, then restored.

Who may call: ``python -m a4prefill b12x-compile``, ``scripts/compile_b12x.sh``, tests.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from a4prefill.ops.backends import b12x_plans
from a4prefill.ops.backends.b12x_plans import A4, W4A16
from a4prefill.ops.backends.b12x_weights import translate_weights
from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.scales import A4Scales

ELF_MAGIC = b"\x7fELF"
EM_CUDA = 190  # ELF machine type of CUDA device code


@dataclass(frozen=True)
class OfflineTarget:
    """The device facts b12x's compile workers need (what ``detect_device`` reports on it)."""

    arch: str  # "sm_120a"
    compute_capability: tuple[int, int]
    sm_count: int
    product_name: str
    max_shared_memory_per_block: int  # bytes, opt-in per block
    max_shared_memory_per_multiprocessor: int  # bytes


# RTX PRO 6000 Blackwell (cc 12.0, 188 SMs) and GB10 / DGX Spark (cc 12.1, 48 SMs); shared memory:
# 99 KiB per block (opt-in), 100 KiB per SM on both.
TARGETS = {
    "sm_120a": OfflineTarget("sm_120a", (12, 0), 188, "NVIDIA RTX PRO 6000 Blackwell", 101376, 102400),
    "sm_121a": OfflineTarget("sm_121a", (12, 1), 48, "NVIDIA GB10", 101376, 102400),
}


@dataclass(frozen=True)
class CompiledProgram:
    """One program the preparation of ``plan`` compiles: its b12x name, ``dialect`` (``cute`` or
    ``triton``), where it lies, the architectures its device code targets, its kernels."""

    plan: str
    dialect: str
    name: str
    path: str
    archs: tuple[str, ...]
    kernels: tuple[str, ...]


@dataclass(frozen=True)
class PlanCompilation:
    """What compiling one plan of one layer did: its programs, the variants (token counts) of its
    execution declaration, b12x's compile summary, wall seconds."""

    plan: str
    variants: tuple[int, ...]
    programs: tuple[CompiledProgram, ...]
    summary: str
    seconds: float


def _check_target(arch: str) -> OfflineTarget:
    if arch not in TARGETS:
        raise ValueError(f"arch must be one of {sorted(TARGETS)}, got {arch!r}")
    return TARGETS[arch]


@contextlib.contextmanager
def _device_properties(target: OfflineTarget) -> Iterator[None]:
    """``torch.cuda.get_device_properties`` answers for ``target`` while active (b12x's W4A16
    preparation sizes a workspace by the SM count); b12x's SM-count memo is cleared around it."""
    from b12x._lib import utils

    properties = type(
        "OfflineDeviceProperties",
        (),
        {
            "major": target.compute_capability[0],
            "minor": target.compute_capability[1],
            "multi_processor_count": target.sm_count,
            "name": target.product_name,
            "shared_memory_per_block_optin": target.max_shared_memory_per_block,
            "shared_memory_per_multiprocessor": target.max_shared_memory_per_multiprocessor,
        },
    )()
    original = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda device=None: properties
    utils._num_sm_cache.clear()
    try:
        yield
    finally:
        torch.cuda.get_device_properties = original
        utils._num_sm_cache.clear()


def _detected_device(target: OfflineTarget) -> Any:
    from b12x.preparation.device import DetectedDevice
    from b12x.preparation.types import DeviceIdentity

    identity = DeviceIdentity(
        vendor="nvidia",
        compute_capability=target.compute_capability,
        sm_count=target.sm_count,
        product_name=target.product_name,
    )
    return DetectedDevice(
        ordinal=0,
        identity=identity,
        uuid=f"GPU-offline-{target.arch}",
        max_shared_memory_per_block=target.max_shared_memory_per_block,
        max_shared_memory_per_multiprocessor=target.max_shared_memory_per_multiprocessor,
    )


def _worker_description(target: OfflineTarget) -> tuple[Any, ...]:
    """The positional arguments of b12x's ``compile_pool._initialize_worker`` but the last."""
    return (
        0,
        target.compute_capability,
        f"GPU-offline-{target.arch}",
        target.product_name,
        target.sm_count,
        target.max_shared_memory_per_block,
        target.max_shared_memory_per_multiprocessor,
    )


def declaration_variants(declaration: Any) -> dict[int, Any]:
    """``token count -> plan`` of an execution declaration (one plan, or several variants)."""
    variants = getattr(declaration, "variants", None)
    return dict(variants) if variants is not None else {declaration.query.num_tokens: declaration}


def compile_jobs(declaration: Any, target: OfflineTarget) -> list[Any]:
    """The compile jobs ``prepare_default`` runs for ``declaration`` on ``target``: per variant,
    those of b12x's default configuration (a pinned override where the plan has one)."""
    device = _detected_device(target)
    jobs = []
    with _device_properties(target):
        for _, plan in sorted(declaration_variants(declaration).items()):
            configuration = plan.contract.configure(
                plan.query, device=device.identity, override=plan.override, search=False
            )
            config = configuration.pinned if configuration.pinned is not None else configuration.default
            jobs.extend(plan._compile_jobs(config, device))
    return jobs


def _describe(jobs: list[Any], target: OfflineTarget) -> list[Any]:
    """b12x's ``describe_compilation`` of each job (program keys, no lowering) in one spawned
    child with the device faked, as b12x's compile workers run."""
    from b12x._lib import compile_pool

    context = multiprocessing.get_context("spawn")
    activity = context.Array("q", (0, 0))
    with compile_pool._offline_compiler_spawn_environment():
        pool = context.Pool(
            1, initializer=compile_pool._initialize_worker, initargs=(*_worker_description(target), activity)
        )
    try:
        return [pool.apply(compile_pool.describe_compilation, (job,)) for job in jobs]
    finally:
        pool.terminate()
        pool.join()


def _compile(plans: list[Any], target: OfflineTarget, workers: int) -> str:
    from b12x._lib.compile_pool import CompilePool

    ordinal, capability, uuid, product, sms, per_block, per_sm = _worker_description(target)
    with CompilePool(
        device_ordinal=ordinal,
        compute_capability=capability,
        device_uuid=uuid,
        product_name=product,
        sm_count=sms,
        max_shared_memory_per_block=per_block,
        max_shared_memory_per_multiprocessor=per_sm,
        workers=workers,
    ) as pool:
        pool.wait(pool.submit_plans(plans))
        return str(pool.summary())


def cuobjdump() -> Path:
    """Triton's bundled ``cuobjdump``."""
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def embedded_cuda_images(data: bytes) -> list[bytes]:
    """The CUDA ELF images (machine 190, 64-bit) inside a host object's bytes."""
    images = []
    start = data.find(ELF_MAGIC, 1)
    while start >= 0:
        header = data[start : start + 64]
        if len(header) == 64 and header[4] == 2 and struct.unpack_from("<H", header, 18)[0] == EM_CUDA:
            (program_offset,) = struct.unpack_from("<Q", header, 32)
            (section_offset,) = struct.unpack_from("<Q", header, 40)
            program_size, program_count, section_size, section_count = struct.unpack_from("<HHHH", header, 54)
            end = max(
                section_offset + section_size * section_count, program_offset + program_size * program_count
            )
            images.append(data[start : start + end])
        start = data.find(ELF_MAGIC, start + 1)
    return images


def cuda_image_facts(image: bytes, scratch: Path) -> tuple[str, tuple[str, ...]]:
    """``(arch, kernels)`` of one CUDA ELF image, from ``cuobjdump -elf`` and ``-sass``
    (``arch`` as ``sm_120a``; empty when cuobjdump reports none)."""
    scratch.write_bytes(image)
    tool = str(cuobjdump())
    listing = subprocess.run([tool, "-elf", str(scratch)], capture_output=True, text=True, check=True).stdout
    arch = ""
    for line in listing.splitlines():
        if line.startswith("64-bit ELF") and "sm=" in line:
            arch = "sm_" + line.split("sm=", 1)[1].split(",", 1)[0]
            break
    sass = subprocess.run([tool, "-sass", str(scratch)], capture_output=True, text=True, check=True).stdout
    kernels = tuple(
        line.split(":", 1)[1].strip() for line in sass.splitlines() if line.strip().startswith("Function :")
    )
    return arch, kernels


def _program(plan: str, program: Any, scratch: Path) -> CompiledProgram:
    """Where b12x's ``program`` (a CuTe or Triton program key) lies and what its device code is."""
    if program.dialect == "cute":
        from b12x._lib import compiler

        location = Path(compiler._cache_object_path(program.key))
        images = embedded_cuda_images(location.read_bytes())
    else:
        from triton.compiler.compiler import get_cache_manager

        group = get_cache_manager(program.key).get_group(f"{program.name[:150]}.json") or {}
        cubins = [Path(value) for key, value in group.items() if key.endswith(".cubin")]
        location = cubins[0] if cubins else Path()
        images = [cubin.read_bytes() for cubin in cubins]
    facts = [cuda_image_facts(image, scratch) for image in images]
    archs = tuple(arch for arch, _ in facts)
    kernels = tuple(name for _, names in facts for name in names)
    return CompiledProgram(plan, program.dialect, program.name, str(location), archs, kernels)


# Expert shapes the CLI and the tests compile: make_tiny_layer's default layer and the
# GLM-5.3-Flash TP2 experts; (experts, hidden, intermediate, top_k).
SHAPES = {"tiny": (8, 256, 128, 2), "glm-tp2": (288, 4096, 1024, 8)}


def placeholder_layer(experts: int, hidden: int, intermediate: int) -> tuple[NvFp4Experts, A4Scales]:
    """A calibrated layer of the given sizes whose values do not matter (zero codes and block
    scales, unit global and encode scales): what compiles depends on the shapes only."""
    e4m3 = torch.float8_e4m3fn
    weights = NvFp4Experts(
        torch.zeros(experts, 2 * intermediate, hidden // 2, dtype=torch.uint8),
        torch.zeros(experts, 2 * intermediate, hidden // 16, dtype=e4m3),
        torch.ones(experts, 2),
        torch.zeros(experts, hidden, intermediate // 2, dtype=torch.uint8),
        torch.zeros(experts, hidden, intermediate // 16, dtype=e4m3),
        torch.ones(experts),
    )
    return weights, A4Scales(torch.ones(1), torch.ones(experts))


def compile_layer(
    experts: NvFp4Experts,
    a4_scales: A4Scales | None,
    top_k: int,
    max_tokens: int,
    arch: str,
    io_dtype: torch.dtype = torch.bfloat16,
    swiglu_limit: float | None = None,
    workers: int = 1,
) -> list[PlanCompilation]:
    """Compile the b12x kernels that the b12x backend's preparation of this layer compiles on
    ``arch`` (``sm_120a`` or ``sm_121a``): the ``w4a16`` plan and, with ``a4_scales``, the ``a4``
    plan, for calls of up to ``max_tokens`` rows of top-``top_k`` routing. ``experts`` on the CPU
    (the values do not matter, the shapes do). ``workers``: b12x compile processes."""
    target = _check_target(arch)
    geometry = b12x_plans.check_geometry(experts.w13_weight, experts.w2_weight, top_k, max_tokens)
    tensors = translate_weights(experts, a4_scales)
    results = []
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"a4prefill-b12x-{os.getpid()}.cubin"
    try:
        for precision in (W4A16, A4) if a4_scales is not None else (W4A16,):
            started = time.perf_counter()
            plan_tensors = tensors if b12x_plans.shares_storage(precision, io_dtype) else tensors.clone()
            weight_plan = b12x_plans.plan_weights(geometry, precision, io_dtype, swiglu_limit)
            with _device_properties(target):
                prepared = b12x_plans.prepare_weights(weight_plan, plan_tensors)
            declaration = b12x_plans.plan_execution(prepared, geometry)
            descriptions = _describe(compile_jobs(declaration, target), target)
            summary = _compile(descriptions, target, workers)
            programs = tuple(
                _program(precision, program, scratch) for item in descriptions for program in item.programs
            )
            variants = tuple(sorted(declaration_variants(declaration)))
            results.append(
                PlanCompilation(precision, variants, programs, summary, time.perf_counter() - started)
            )
    finally:
        scratch.unlink(missing_ok=True)
    return results


def report(compilations: list[PlanCompilation]) -> dict[str, Any]:
    """A JSON-serialisable account of :func:`compile_layer`'s result."""
    return {
        "plans": [
            {
                "plan": item.plan,
                "variants": list(item.variants),
                "seconds": round(item.seconds, 2),
                "summary": item.summary,
                "programs": [
                    {
                        "dialect": p.dialect,
                        "name": p.name,
                        "archs": list(p.archs),
                        "kernels": list(p.kernels),
                        "path": p.path,
                    }
                    for p in item.programs
                ],
            }
            for item in compilations
        ]
    }


def format_report(compilations: list[PlanCompilation]) -> str:
    """One line per plan, then one per program: dialect, name, targets, kernels."""
    lines = []
    for item in compilations:
        lines.append(
            f"plan {item.plan}: variants {list(item.variants)} tokens, {len(item.programs)} programs, "
            f"{item.seconds:.1f} s ({item.summary})"
        )
        for p in item.programs:
            kernels = ", ".join(k.split("(")[0][:60] for k in p.kernels[:4]) or "-"
            lines.append(
                f"  {p.dialect:<6} {p.name:<34} {','.join(p.archs) or 'NO DEVICE CODE':<10} {kernels}"
            )
    return "\n".join(lines)
