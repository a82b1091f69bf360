"""Gluon kernels without a GPU (tests only): offline compilation for sm_90a, and launches that run
the compiled TTGIR on CPU tensors through :mod:`ttgir_interpreter`.

``compile_sm90`` is what the launcher would compile on an H100/H200 for the given argument types
(pointers and sizes divisible by 16 marked as such, as Triton's launcher specializes them).
``InterpretedKernel`` stands in for a Gluon kernel object: ``kernel[grid](*args, **kwargs)``
compiles it with the launch's constexprs and argument types, then interprets every program.
"""

from __future__ import annotations

from typing import Any

import torch

from helpers.ttgir_interpreter import Kernel

POINTER_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.uint16: "*u16",
    torch.float8_e4m3fn: "*fp8e4nv",
}


def _source(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], divisible: set[str]) -> Any:
    """Triton's compile source for ``fn`` (Gluon or plain Triton) with these argument types."""
    import triton
    from triton.experimental import gluon

    names = list(fn.arg_names)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    # parameters given neither way take their defaults, as the launcher binds them (constexprs)
    defaults = {
        param.name: param.default
        for param in fn.params
        if param.has_default and param.name not in signature and param.name not in constexprs
    }
    constexprs = {**constexprs, **defaults}
    # a plain Triton kernel (@triton.jit) compiles through Triton's own front end
    source_type = gluon._runtime.GluonASTSource
    if not isinstance(fn, gluon._runtime.GluonJITFunction):
        source_type = triton.compiler.ASTSource
    return source_type(
        fn=fn,
        signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
        constexprs=constexprs,
        attrs=attrs,
    )


def _launch_options(num_warps: int, maxnreg: int | None) -> dict[str, Any]:
    """The launch options both compile paths pass to Triton's backend."""
    return {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}


def compile_sm90(
    fn: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    num_warps: int,
    divisible: set[str],
    maxnreg: int | None = None,
) -> Any:
    """Compile Gluon (or plain Triton) kernel ``fn`` for sm_90a offline: ``signature`` maps its
    runtime arguments to Triton types, ``divisible`` names those known divisible by 16,
    ``maxnreg`` caps the registers per thread (launch option, as on the GPU). Returns the
    compiled kernel (``.asm`` has ``ttgir``, ``ptx``, ``cubin``)."""
    import triton
    from triton.backends.compiler import GPUTarget

    source = _source(fn, signature, constexprs, divisible)
    return triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options=_launch_options(num_warps, maxnreg)
    )


def compile_ttgir_sm90(
    fn: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    num_warps: int,
    divisible: set[str],
    maxnreg: int | None = None,
) -> str:
    """The TTGIR :func:`compile_sm90` would produce (its ``.asm["ttgir"]``, the same passes),
    without the stages after it (LLVM IR, PTX, ptxas: about three quarters of a cold compile)
    and without Triton's disk cache: what the interpreter runs."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    source = _source(fn, signature, constexprs, divisible)
    options = backend.parse_options({**_launch_options(num_warps, maxnreg), **source.parse_options()})
    stages: dict[str, Any] = {}
    backend.add_stages(stages, options, source.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    codegen = backend.get_codegen_implementation(options)
    module = source.make_ir(target, options, codegen, backend.get_module_map(), context)
    metadata: dict[str, Any] = {"target": target, **options.__dict__}
    names = list(stages)
    for name in names[names.index(source.ext) : names.index("ttgir") + 1]:
        module = stages[name](module, metadata)
    return str(module)


class InterpretedKernel:
    """A Gluon kernel launched on CPU tensors: compiled offline for sm_90a per constexpr set and
    argument types (cached), its TTGIR interpreted program by program. ``launches`` records the
    grid of every launch, ``reads`` the elements its loads read per tensor argument (by name),
    ``accessed`` per tensor argument which elements were read and which were prefetched into L2
    (bool per element of its storage, ``None`` for none), ``before_wait`` the tensor arguments
    a program read or wrote before its first ``griddepcontrol.wait``. ``launch_pdl`` is accepted
    and ignored: the interpreter runs launches one after the other."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.launches: list[tuple[int, ...]] = []
        self.reads: list[dict[str, int]] = []
        self.accessed: list[dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]] = []
        self.before_wait: list[set[str]] = []
        self._kernels: dict[str, Kernel] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **kwargs: self._launch(tuple(grid), args, kwargs)

    def _launch(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        kwargs = dict(kwargs)
        num_warps = kwargs.pop("num_warps", 4)
        maxnreg = kwargs.pop("maxnreg", None)
        kwargs.pop("launch_pdl", None)  # launches run one after the other here
        bound = dict(zip(self.fn.arg_names, args, strict=False)) | kwargs
        constexprs, runtime, signature, divisible = {}, [], {}, set()
        for param in self.fn.params:
            value = bound[param.name] if param.name in bound or not param.has_default else param.default
            if param.is_constexpr or value is None:  # None binds as a constexpr, as in Triton
                constexprs[param.name] = value
                continue
            if hasattr(value, "block_shape"):  # a host TMA descriptor: flattened as Triton passes it
                element = POINTER_TYPES[value.base.dtype].removeprefix("*")
                signature[param.name] = f"tensordesc<{element}{list(value.block_shape)},{value.layout!r}>"
                runtime += [value, *value.shape, *value.strides]
                continue
            runtime.append(value)
            if isinstance(value, torch.Tensor):
                signature[param.name] = POINTER_TYPES[value.dtype]
                if value.data_ptr() % 16 == 0:
                    divisible.add(param.name)
            elif isinstance(value, float):
                signature[param.name] = "fp32"
            else:
                signature[param.name] = "i32"
                if value % 16 == 0:
                    divisible.add(param.name)
        key = repr(
            (sorted(constexprs.items()), sorted(signature.items()), sorted(divisible), num_warps, maxnreg)
        )
        if key not in self._kernels:
            ttgir = compile_ttgir_sm90(self.fn, signature, constexprs, num_warps, divisible, maxnreg)
            self._kernels[key] = Kernel.from_ttgir(ttgir)
        self.launches.append(grid)
        accesses = self._kernels[key].launch(grid, runtime)
        tensors = {name: value for name, value in bound.items() if isinstance(value, torch.Tensor)}
        self.reads.append(
            {
                name: accesses.reads.get(value.untyped_storage().data_ptr(), 0)
                for name, value in tensors.items()
            }
        )
        self.before_wait.append(
            {
                name
                for name, value in tensors.items()
                if value.untyped_storage().data_ptr()
                in accesses.read_before_wait | accesses.stored_before_wait
            }
        )
        self.accessed.append(
            {
                name: (accesses.read.get(key), accesses.prefetched.get(key))
                for name, value in tensors.items()
                for key in [value.untyped_storage().data_ptr()]
            }
        )


def interpreted_shared_kernel(patch: Any, name: str = "gather_rows_kernel") -> None:
    """Have ``patch`` (a ``pytest.MonkeyPatch``) replace the plain Triton kernel ``name`` of
    ``shared_kernels`` (by default ``gather_rows_kernel``, which gathers the warp-specialized
    FC1's rows) by Triton's own CPU interpreter, for tests that run that kernel's launcher on CPU
    tensors."""
    from triton.runtime.interpreter import InterpretedFunction

    from a4prefill.ops.backends.triton import shared_kernels

    patch.setattr(shared_kernels, name, InterpretedFunction(getattr(shared_kernels, name).fn))
