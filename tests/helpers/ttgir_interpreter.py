"""A CPU interpreter for the TritonGPU IR (TTGIR) of the decode kernels (tests only).

Triton's own interpreter does not run Gluon kernels, and this machine has no GPU. This module runs
the TTGIR that Triton compiles a Gluon kernel to (``compiled.asm["ttgir"]``: after Triton's
optimization passes, the program that is lowered to PTX) on torch CPU tensors, one program of
the grid at a time, with value semantics: a tensor is its logical values, layouts are ignored
(``ttg.convert_layout`` is the identity), ``tt.reshape``/``tt.trans``/``tt.join`` are the
row-major logical operations, ``tt.dot`` is an fp32-accumulated matrix product (computed
exactly, then rounded once: the MMA's own addition order differs), and
``tt.elementwise_inline_asm`` runs through :mod:`ptx_subset`. So what it checks is the
program's logic (offsets, masks, relabellings, epilogues), not Triton's lowering of layouts.

Memory: pointer arguments are torch tensors (contiguous); a pointer value is ``(buffer, element
offsets)``. An unmasked load or store outside its buffer raises ``IndexError`` (on a GPU it would
read or write another allocation silently), and so does a store to an element another program of
the same launch has stored to: a GPU runs the programs in no fixed order, so that is a race whose
outcome the interpreter's program order would hide. ``Kernel.launch`` counts the elements
each buffer's loads read (masked-off lanes read nothing, as on a GPU) and marks which.

An inline asm whose only operand is a pointer and whose body is ``prefetch.global.L2 [$1]`` (an
L2 prefetch) reads nothing: the interpreter checks its addresses against the buffer's bounds and
marks the elements they point at. ``griddepcontrol.launch_dependents`` and ``griddepcontrol.wait``
(programmatic dependent launch) do nothing here, as launches run one after the other; what a
program loads or stores before its first ``griddepcontrol.wait`` is recorded per buffer, since on a
GPU it may run while the previous grid still does.

Shared memory (``ttg.local_alloc``) is a tensor per allocation, filled with a garbage pattern.
``ttg.async_copy_global_to_local`` (``cp.async``) reads global memory when issued but lands as
late as the program allows: its commit group is written only when a ``ttg.async_wait`` needs it
(masked-off elements land as zeros, as ``cp.async`` zero-fills). A program that reads a stage
before waiting for its copy, or overwrites it before reading it, gets the wrong data.

Warp specialization (``ttg.warp_specialize``): the default region and each worker partition run
as partitions of one program, each with its own values, copy groups and wgmmas in flight, on
one thread of control at a time (:class:`_Scheduler`): a partition runs until it waits on an
mbarrier phase that has not completed, then the next partition that can go on runs (workers
first: a producer runs as far ahead as its barriers let it; ``Kernel.default_partition_first``
turns the order round). After every arrival the turn goes to the first partition in that order
that can go on, so a slot released too early is refilled before its reader reads it. No
partition can go on while one has not finished: ``Deadlock``, naming each partition's wait.
mbarriers follow Triton's lowering (checked in the PTX of Triton 3.6 and 3.9):
``ttng.init_barrier`` sets the arrival count; ``ttng.arrive_barrier`` is one arrival of
``count`` per partition (after a barrier of the partition's warps, one thread arrives);
``ttng.async_copy_mbarrier_arrive`` with ``noIncrement`` (``cp.async.mbarrier.arrive.noinc``)
is one arrival per thread of the partition, made when the thread's earlier ``cp.async`` copies
land: the copies land when the phase they belong to completes, as late as a GPU may land them.
``ttng.wait_barrier`` with parity ``p`` returns once the phase of that parity completed (``try_wait.parity``).
TMA (host tensor descriptors, passed as Gluon's ``TensorDescriptor``): ``ttng.barrier_expect``
is ``mbarrier.arrive.expect_tx``, one arrival that expects a byte count in the phase;
``ttng.async_tma_copy_global_to_local`` reads the descriptor's box when issued (rows and columns
outside the tensor as zeros) and puts it in flight on the mbarrier. The phase completes, and its
boxes land, when a wait observes every arrival made and exactly the expected bytes in flight: a
wrong byte count leaves the phase open (a wait on it never returns), and a read before the wait
gets garbage.

Only the ops these kernels use are implemented; anything else raises ``NotImplementedError``
naming the op, so a kernel change that needs more is noticed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import re
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from helpers import ptx_subset

TORCH_TYPES = {
    "i1": torch.bool,
    "i8": torch.int8,
    "i16": torch.int16,
    "i32": torch.int32,
    "i64": torch.int64,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f32": torch.float32,
    "f64": torch.float64,
    "f8E4M3FN": torch.float8_e4m3fn,
}
UNSIGNED = {torch.int8: torch.uint8, torch.int16: torch.uint16, torch.int32: torch.uint32}
CMP = {  # arith.cmpi predicates (signed) and the ordered arith.cmpf ones, plus une
    "eq": torch.eq,
    "ne": torch.ne,
    "slt": torch.lt,
    "sle": torch.le,
    "sgt": torch.gt,
    "sge": torch.ge,
    "oeq": torch.eq,
    "olt": torch.lt,
    "ole": torch.le,
    "ogt": torch.gt,
    "oge": torch.ge,
    "une": torch.ne,
}


@dataclasses.dataclass(frozen=True)
class Type:
    """An IR type: ``shape`` () for scalars, ``element`` an IR scalar type, or ``!tt.ptr<T>``."""

    shape: tuple[int, ...]
    element: str

    @property
    def pointee(self) -> str:
        match = re.fullmatch(r"!tt\.ptr<(\w+)>", self.element)
        if match is None:
            raise ValueError(f"{self.element} is not a pointer type")
        return match.group(1)


@dataclasses.dataclass
class Pointer:
    """A pointer value: a flat buffer and int64 element offsets (0-d for a scalar pointer)."""

    buffer: torch.Tensor
    offsets: torch.Tensor


@dataclasses.dataclass
class Op:
    results: list[str]
    name: str
    text: str  # everything after the op name on its line(s), locations removed
    regions: list[list[Any]]  # nested op lists (and block labels) of scf.for / scf.if / tt.reduce

    @functools.cached_property
    def operands(self) -> list[str]:
        """Names of the values the op reads, in order (attributes and strings left out)."""
        head = _remove_nested(self.text, "{", "}").split(" : ", 1)[0]
        return re.findall(r"%[\w\-.]+(?:#\d+)?", head)

    @functools.cached_property
    def types(self) -> tuple[list[Type], list[Type]]:
        """(input types, result types) from the op's trailing ``: ...`` signature."""
        text = _remove_nested(_remove_nested(self.text, "{", "}"), "[", "]")
        if " : " not in text:
            return [], []
        signature = text.split(" : ", 1)[1]
        inputs, _, outputs = signature.partition("->")
        if " to " in inputs:
            inputs, outputs = inputs.split(" to ")
        parsed = [parse_type(t) for t in _split_top(inputs.replace(" * ", ", ").strip().strip("()"))]
        if not outputs:  # one type for operands and result (arith ops, constants)
            return parsed, parsed[-1:]
        return parsed, [parse_type(t) for t in _split_top(outputs.strip().strip("()"))]


def strip_locations(text: str) -> str:
    """Remove every ``loc(...)`` (nested parentheses included) and location alias lines."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("loc(", i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            depth = 0
            j = i + 3
            while True:
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                if depth == 0:
                    break
                j += 1
            i = j + 1
            continue
        out.append(text[i])
        i += 1
    return "\n".join(line for line in "".join(out).splitlines() if not line.startswith("#"))


def _remove_nested(text: str, opening: str, closing: str) -> str:
    """``text`` without any ``opening ... closing`` groups (balanced) and without string literals."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    out, depth = [], 0
    for char in text:
        if char == opening:
            depth += 1
        elif char == closing and depth:
            depth -= 1
        elif not depth:
            out.append(char)
    return "".join(out)


def _split_top(text: str, separator: str = ",") -> list[str]:
    parts, depth, current = [], 0, []
    for char in text:
        depth += {"<": 1, "(": 1, "[": 1, "{": 1, ">": -1, ")": -1, "]": -1, "}": -1}.get(char, 0)
        if char == separator and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


def parse_type(text: str) -> Type:
    text = text.strip()
    match = re.fullmatch(r"tensor<((?:\d+x)+)(.+?)(?:,\s*#.*)?>", text, re.S)
    if match:
        return Type(tuple(int(d) for d in match.group(1).rstrip("x").split("x")), match.group(2).strip())
    return Type((), text)


def _attribute(op: Op, name: str) -> str:
    match = re.search(rf"\b{name} = ([^,}}]+(?:<[^>]*>)?)", op.text)
    if match is None:
        raise KeyError(f"{op.name} has no attribute {name}: {op.text[:200]}")
    return match.group(1).strip()


def _parse_ops(lines: list[str], index: int) -> tuple[list[Any], int]:
    """Ops (and ``^bb`` labels) from ``lines[index]`` up to the closing ``}`` of this region."""
    items: list[Any] = []
    while index < len(lines):
        line = lines[index].strip()
        index += 1
        if not line:
            continue
        if line.startswith("}"):
            return items, index - 1
        if line.startswith("^"):
            items.append(line.split("//")[0].strip())  # e.g. "^bb1:" or "^bb0(%a: f32, %b: f32):"
            continue
        match = re.match(r'(?:(%[\w\-.]+(?:, %[\w\-.]+)*)(?::(\d+))? = )?"?([a-z_]+\.[a-z_.]+)"?(.*)', line)
        if match is None:
            raise ValueError(f"cannot parse {line[:200]!r}")
        name, count, op_name, rest = match.groups()
        if name is None:
            results = []
        elif ", " in name:  # named results, e.g. "%outLHS, %outRHS = tt.split ..."
            results = name.split(", ")
        else:
            results = [name] if count is None else [f"{name}#{i}" for i in range(int(count))]
        op = Op(results, op_name, rest, [])
        if op_name == "ttg.warp_specialize":
            index = _parse_partitions(op, lines, index)
        elif rest.rstrip().endswith("{"):
            region, index = _parse_ops(lines, index)
            op.regions.append(region)
            while lines[index].strip() == "} else {":  # scf.if's else region
                region, index = _parse_ops(lines, index + 1)
                op.regions.append(region)
            # the region's braces go; the closing line may carry the signature (tt.reduce)
            head = rest.rstrip().removesuffix("{").rstrip().removesuffix("(")
            op.text = head + " " + lines[index].strip().lstrip("})")
            index += 1
        items.append(op)
    return items, index


def _parse_partitions(op: Op, lines: list[str], index: int) -> int:
    """The regions of a ``ttg.warp_specialize`` from ``lines[index]`` (its ``default {`` line)
    to the ``} : (...) -> (...)`` that closes its last partition: one region per partition, each
    led by its header line (``"default"`` or ``"partition0(%arg3: ...) num_warps(1)"``)."""
    while True:
        header = lines[index].strip()
        if not (header == "default {" or header.startswith("partition")) or not header.endswith("{"):
            raise ValueError(f"cannot parse the warp_specialize region header {header[:200]!r}")
        region, index = _parse_ops(lines, index + 1)
        op.regions.append([header.removesuffix("{").strip(), *region])
        closing = lines[index].strip()
        index += 1
        if closing != "}":  # "} : (types) -> (types)": the last partition
            return index


@dataclasses.dataclass
class Kernel:
    """One ``tt.func`` of a TTGIR module: argument names in order and its body."""

    name: str
    arguments: list[str]
    body: list[Any]
    num_warps: int
    # warp specialization: which partition takes the turn first (module docstring); workers first
    # lets a producer run ahead, the default partition first makes a consumer that reads before
    # its wait see unlanded data
    default_partition_first: bool = False

    @classmethod
    def from_ttgir(cls, ttgir: str) -> Kernel:
        lines = strip_locations(ttgir).splitlines()
        warps = int(re.search(r'"ttg.num-warps" = (\d+)', ttgir).group(1))  # type: ignore[union-attr]
        for i, line in enumerate(lines):
            match = re.match(r"\s*tt\.func public @(\w+)\((.*)\)(?: attributes .*)? \{$", line)
            if match:
                arguments = [
                    re.match(r"(%[\w.]+):", a).group(1)  # type: ignore[union-attr]
                    for a in _split_top(match.group(2))
                ]
                body, _ = _parse_ops(lines, i + 1)
                return cls(match.group(1), arguments, body, warps)
        raise ValueError("no public tt.func in the module")

    def launch(self, grid: tuple[int, ...], arguments: list[Any]) -> Accesses:
        """Run every program of ``grid`` (1-3 axes, x fastest) with ``arguments`` (tensors for
        pointer arguments, Python ints and floats for scalars) in the kernel's order. Returns what
        the programs' loads read and their L2 prefetches asked for."""
        grid = tuple(grid) + (1,) * (3 - len(grid))
        writers: dict[int, torch.Tensor] = {}  # buffer -> the program that stored each element
        accesses = Accesses({}, {}, {}, set(), set())
        for z in range(grid[2]):
            for y in range(grid[1]):
                for x in range(grid[0]):
                    _Program(self, (x, y, z), grid, arguments, writers, accesses).run()
        return accesses


@dataclasses.dataclass
class Accesses:
    """What one launch's programs did with global memory, per buffer (``data_ptr`` of its storage):
    ``reads`` the elements loads read (summed over programs and loads), ``read`` and
    ``prefetched`` which elements were read and which an L2 prefetch pointed at (bool, one per
    element), ``read_before_wait`` and ``stored_before_wait`` the buffers loaded from and stored
    to by a program before its first ``griddepcontrol.wait`` (all of them in kernels that never
    wait)."""

    reads: dict[int, int]
    read: dict[int, torch.Tensor]
    prefetched: dict[int, torch.Tensor]
    read_before_wait: set[int]
    stored_before_wait: set[int]

    @staticmethod
    def mark(marks: dict[int, torch.Tensor], buffer: torch.Tensor, offsets: torch.Tensor) -> None:
        key = buffer.untyped_storage().data_ptr()
        if key not in marks:  # not setdefault: its default would be allocated on every call
            marks[key] = torch.zeros(buffer.numel(), dtype=torch.bool)
        marks[key][offsets] = True


def _statements(asm: str) -> list[str]:
    """The non-empty ``;``-separated statements of a one-block inline asm ``{ ... }``."""
    statements = (s.strip() for s in asm.strip().removeprefix("{").removesuffix("}").split(";"))
    return [s for s in statements if s]


class _Return(Exception):
    pass


class _PendingDot:
    """An asynchronous wgmma in flight: its operands (shared-memory views or tensors) and its
    accumulator (a tensor or the previous wgmma in flight). :meth:`result` computes it once."""

    def __init__(self, a: Any, b: Any, c: Any, use_c: bool) -> None:
        self.a, self.b, self.c, self.use_c = a, b, c, use_c
        self.done: torch.Tensor | None = None

    def result(self) -> torch.Tensor:
        if self.done is None:
            c = self.c.result() if isinstance(self.c, _PendingDot) else self.c
            product = torch.matmul(self.a.double(), self.b.double())
            self.done = (product + (c.double() if self.use_c else 0.0)).float()
        return self.done


class Deadlock(RuntimeError):
    """No partition of a warp-specialized program can go on and not all have finished."""


@dataclasses.dataclass
class _Barrier:
    """One mbarrier: its arrival ``count``, the arrivals ``pending`` in the current phase, the
    transaction bytes ``tx`` that ``expect`` announced in it, the phases ``completed`` so far, the
    ``cp.async`` copies (shared memory, values) that land when the current phase completes, and
    the TMA copies in flight (shared memory, values, bytes).

    A phase completes once no arrival is pending and its TMA copies bring exactly the announced
    bytes. TMA copies land as late as a GPU may land them: when a wait (or a later arrival)
    observes the barrier, not when they are issued."""

    count: int
    pending: int
    completed: int = 0
    tx: int = 0
    copies: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    transfers: list[tuple[torch.Tensor, torch.Tensor, int]] = dataclasses.field(default_factory=list)

    def arrive(self, arrivals: int, expect_bytes: int = 0) -> None:
        """``arrivals`` arrivals, the last one announcing ``expect_bytes`` transaction bytes in
        this phase (``mbarrier.arrive.expect_tx``)."""
        self._complete_if_done()
        if arrivals > self.pending:
            raise RuntimeError(
                f"{arrivals} arrivals on an mbarrier expecting {self.pending} more in this phase"
            )
        self.pending -= arrivals
        self.tx += expect_bytes
        if not self.transfers and not self.tx:
            self._complete_if_done()

    def transfer(self, memory: torch.Tensor, values: torch.Tensor, nbytes: int) -> None:
        """A TMA copy of ``nbytes`` tracked by this barrier (``complete_tx::bytes``), in flight."""
        self.transfers.append((memory, values, nbytes))

    def phase_done(self, parity: int) -> bool:
        """``mbarrier.try_wait.parity``: whether the phase of ``parity`` completed (the current,
        incomplete phase has the other parity)."""
        self._complete_if_done()
        return self.completed % 2 != parity

    def _complete_if_done(self) -> None:
        if self.pending or self.tx != sum(nbytes for _, _, nbytes in self.transfers):
            return
        for memory, values in self.copies:
            memory.copy_(values)
        for memory, values, _ in self.transfers:
            memory.copy_(values)
        self.copies, self.transfers, self.tx = [], [], 0
        self.completed += 1
        self.pending = self.count


class _Scheduler:
    """Runs the partitions of one ``ttg.warp_specialize`` one at a time, each on a Python thread
    holding the turn until it finishes or waits (:meth:`wait_until`); the turn goes to the first
    partition in ``order`` that can go on."""

    def __init__(self, count: int, order: list[int]) -> None:
        self.condition = threading.Condition()
        self.order = order
        self.turn: int | None = None
        self.done = [False] * count
        self.waiting: dict[int, tuple[Callable[[], bool], str]] = {}
        self.error: BaseException | None = None

    def run(self, bodies: list[Callable[[], None]]) -> None:
        threads = [
            threading.Thread(target=self._body, args=(i, body), daemon=True) for i, body in enumerate(bodies)
        ]
        for thread in threads:
            thread.start()
        with self.condition:
            self._pass_turn()
            self.condition.wait_for(lambda: all(self.done) or self.error is not None)
        if self.error is not None:
            with self.condition:
                self.done = [True] * len(self.done)
                self.turn = -1
                self.condition.notify_all()
            raise self.error

    def _body(self, i: int, body: Callable[[], None]) -> None:
        with self.condition:
            self.condition.wait_for(lambda: self.turn == i or self.turn == -1)
            if self.turn == -1:
                return
        try:
            body()
        except BaseException as error:  # handed to the launching thread
            with self.condition:
                self.error = self.error or error
                self.condition.notify_all()
            return
        with self.condition:
            self.done[i] = True
            self._pass_turn()

    def preempt(self, i: int) -> None:
        """Partition ``i`` made an arrival: the turn goes to the first partition in ``order`` that
        can go on now (``i`` itself if none before it can), so that a released slot is refilled,
        or a completed phase consumed, before ``i`` takes another step."""
        self._hand_over(i, lambda: True, "its turn after an arrival")

    def wait_until(self, i: int, ready: Callable[[], bool], what: str) -> None:
        """Partition ``i`` waits for ``ready()``: the turn passes on until it holds."""
        if not ready():
            self._hand_over(i, ready, what)

    def _hand_over(self, i: int, ready: Callable[[], bool], what: str) -> None:
        with self.condition:
            self.waiting[i] = (ready, what)
            self._pass_turn()
            self.condition.wait_for(lambda: self.turn == i or self.turn == -1)
            if self.turn == -1:
                raise Deadlock("another partition failed")
            del self.waiting[i]

    def _pass_turn(self) -> None:
        """Give the turn to the first partition in ``order`` that can go on (called holding the
        condition); none while some have not finished: a deadlock."""
        for j in self.order:
            if self.done[j]:
                continue
            waiting = self.waiting.get(j)
            if waiting is None or waiting[0]():
                self.turn = j
                self.condition.notify_all()
                return
        if not all(self.done):
            waits = "; ".join(
                f"partition {j} waits for {what}" for j, (_, what) in sorted(self.waiting.items())
            )
            self.error = self.error or Deadlock(f"no partition can go on: {waits}")
        self.turn = -1
        self.condition.notify_all()


class _Program:
    handlers: ClassVar[dict[str, Callable[..., Any]]] = {}  # op name -> its ``_op_`` method

    def __init__(
        self,
        kernel: Kernel,
        program_id: tuple[int, int, int],
        grid: tuple[int, int, int],
        arguments: list[Any],
        writers: dict[int, torch.Tensor],
        accesses: Accesses,
    ) -> None:
        self.kernel = kernel
        self.program_id = program_id
        self.grid = grid
        self.writers = writers
        self.accesses = accesses
        self.waited = False  # griddepcontrol.wait seen
        self.values: dict[str, Any] = {}
        self.open_copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # async copies not committed
        self.copy_groups: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # committed, not landed
        self.pending_dots: list[_PendingDot] = []  # asynchronous wgmmas not retired, oldest first
        self.warps = kernel.num_warps  # of this partition (the whole program outside warp_specialize)
        self.barriers: dict[int, _Barrier] = {}  # mbarriers by shared-memory address, shared by partitions
        self.scheduler: _Scheduler | None = None  # inside warp_specialize: the partitions' scheduler
        for name, value in zip(kernel.arguments, arguments, strict=True):
            if isinstance(value, torch.Tensor):
                if not value.is_contiguous():
                    raise ValueError(f"{name}: the interpreter needs contiguous buffers")
                value = Pointer(value.reshape(-1), torch.zeros((), dtype=torch.int64))
            elif isinstance(value, bool | int):
                value = torch.tensor(int(value), dtype=torch.int32)
            elif isinstance(value, float):
                value = torch.tensor(value, dtype=torch.float32)
            elif not hasattr(value, "block_shape"):  # a TMA descriptor stays as given
                raise TypeError(f"{name}: unsupported argument {type(value).__name__}")
            self.values[name] = value

    def run(self) -> None:
        with contextlib.suppress(_Return):
            self._run_blocks(self.kernel.body)

    def _run_blocks(self, items: list[Any]) -> None:
        blocks: dict[str, list[Op]] = {"^entry": []}
        order = ["^entry"]
        for item in items:
            if isinstance(item, str):
                label = re.match(r"\^\w+", item).group(0)  # type: ignore[union-attr]
                blocks[label] = []
                order.append(label)
            else:
                blocks[order[-1]].append(item)
        label = "^entry"
        while True:
            target = None
            for op in blocks[label]:
                if op.name == "cf.br":
                    target = op.text.split()[0]
                    break
                if op.name == "cf.cond_br":
                    condition, if_true, if_false = (p.strip() for p in op.text.split(","))
                    target = if_true if bool(self.values[condition]) else if_false
                    break
                if op.name == "tt.return":
                    raise _Return
                self._execute(op)
            if target is None:
                return
            label = target

    def _execute(self, op: Op) -> None:
        handler = _Program.handlers.get(op.name)
        if handler is None:
            handler = getattr(_Program, "_op_" + op.name.replace(".", "_"), None)
            if handler is None:
                raise NotImplementedError(f"the TTGIR interpreter does not implement {op.name}")
            _Program.handlers[op.name] = handler
        result = handler(self, op)
        if op.results:
            results = result if len(op.results) > 1 else [result]
            for name, value in zip(op.results, results, strict=True):
                self.values[name] = value

    def _args(self, op: Op) -> list[Any]:
        return [self.values[name] for name in op.operands]

    # -- constants, ranges, ids ------------------------------------------------------------
    def _op_arith_constant(self, op: Op) -> torch.Tensor:
        if op.text.strip() in ("true", "false"):  # ``arith.constant true``: an i1 without a type
            return torch.tensor(op.text.strip() == "true")
        _, (result,) = op.types
        literal = op.text.split(" : ")[0].strip()
        literal = literal.removeprefix("dense<").removesuffix(">")
        dtype = TORCH_TYPES[result.element]
        if literal in ("true", "false"):
            value: Any = literal == "true"
        elif literal.startswith("0x") and dtype.is_floating_point:
            bits = int(literal, 16)
            value = torch.tensor(bits, dtype=torch.int64).to({2: torch.int16, 4: torch.int32}[dtype.itemsize])
            return value.view(dtype).expand(result.shape).clone()
        else:
            value = float(literal) if dtype.is_floating_point else int(literal, 0)
        return torch.full(result.shape, value, dtype=dtype)

    def _op_tt_make_range(self, op: Op) -> torch.Tensor:
        start, end = (int(_attribute(op, key).split(":")[0]) for key in ("start", "end"))
        return torch.arange(start, end, dtype=torch.int32)

    def _op_tt_get_program_id(self, op: Op) -> torch.Tensor:
        axis = "xyz".index(op.text.split()[0])
        return torch.tensor(self.program_id[axis], dtype=torch.int32)

    def _op_tt_get_num_programs(self, op: Op) -> torch.Tensor:
        axis = "xyz".index(op.text.split()[0])
        return torch.tensor(self.grid[axis], dtype=torch.int32)

    # -- shapes -----------------------------------------------------------------------------
    def _op_tt_splat(self, op: Op) -> Any:
        (value,) = self._args(op)
        _, (result,) = op.types
        if isinstance(value, Pointer):
            return Pointer(value.buffer, value.offsets.expand(result.shape))
        return value.expand(result.shape)

    def _op_tt_broadcast(self, op: Op) -> Any:
        return self._op_tt_splat(op)

    def _op_tt_expand_dims(self, op: Op) -> Any:
        (value,) = self._args(op)
        axis = int(_attribute(op, "axis").split(":")[0])
        if isinstance(value, Pointer):
            return Pointer(value.buffer, value.offsets.unsqueeze(axis))
        return value.unsqueeze(axis)

    def _op_tt_reshape(self, op: Op) -> torch.Tensor:
        if "allow_reorder" in op.text:
            raise NotImplementedError("tt.reshape with allow_reorder has no fixed element order")
        (value,) = self._args(op)
        _, (result,) = op.types
        return value.reshape(result.shape)

    def _op_tt_trans(self, op: Op) -> torch.Tensor:
        (value,) = self._args(op)
        order = [int(x) for x in re.search(r"array<i32: ([\d, ]+)>", op.text).group(1).split(",")]  # type: ignore[union-attr]
        return value.permute(order)

    def _op_tt_join(self, op: Op) -> torch.Tensor:
        a, b = self._args(op)
        return torch.stack([a, b], dim=-1)

    def _op_tt_split(self, op: Op) -> list[torch.Tensor]:
        (value,) = self._args(op)
        return [value[..., 0], value[..., 1]]

    def _op_ttg_convert_layout(self, op: Op) -> Any:
        (value,) = self._args(op)
        return value

    # -- integer and float arithmetic ------------------------------------------------------
    def _binary(self, op: Op, function: Any) -> torch.Tensor:
        a, b = self._args(op)
        _, results = op.types
        result = function(a, b)
        dtype = TORCH_TYPES[(results[0] if results else op.types[0][0]).element]
        return result.to(dtype)

    def _op_arith_addi(self, op: Op) -> torch.Tensor:
        return self._binary(op, torch.add)

    def _op_arith_subi(self, op: Op) -> torch.Tensor:
        return self._binary(op, torch.sub)

    def _op_arith_muli(self, op: Op) -> torch.Tensor:
        return self._binary(op, torch.mul)

    def _op_arith_divsi(self, op: Op) -> torch.Tensor:
        return self._binary(op, lambda a, b: torch.div(a, b, rounding_mode="trunc"))

    def _op_arith_remsi(self, op: Op) -> torch.Tensor:
        return self._binary(op, torch.fmod)

    def _op_arith_andi(self, op: Op) -> torch.Tensor:
        return self._binary(op, torch.bitwise_and)

    def _op_arith_shli(self, op: Op) -> torch.Tensor:
        return self._binary(op, torch.bitwise_left_shift)

    def _op_arith_xori(self, op: Op) -> torch.Tensor:
        return self._binary(op, torch.bitwise_xor)

    def _op_arith_ori(self, op: Op) -> torch.Tensor:
        return self._binary(op, torch.bitwise_or)

    def _op_arith_minsi(self, op: Op) -> torch.Tensor:
        return self._binary(op, torch.minimum)

    def _op_arith_maxsi(self, op: Op) -> torch.Tensor:
        return self._binary(op, torch.maximum)

    def _op_arith_shrsi(self, op: Op) -> torch.Tensor:
        return self._binary(op, torch.bitwise_right_shift)

    def _op_arith_addf(self, op: Op) -> torch.Tensor:
        return self._binary(op, torch.add)

    def _op_arith_subf(self, op: Op) -> torch.Tensor:
        return self._binary(op, torch.sub)

    def _op_arith_mulf(self, op: Op) -> torch.Tensor:
        return self._binary(op, torch.mul)

    def _op_tt_precise_divf(self, op: Op) -> torch.Tensor:
        return self._binary(op, torch.div)

    def _op_arith_divf(self, op: Op) -> torch.Tensor:
        """Triton's approximate fp32 division (``div.full.f32``, within 2 ulps on the GPU),
        evaluated IEEE-rounded: the kernels that use it round the quotient to bf16 after it."""
        return self._binary(op, torch.div)

    def _op_arith_maxnumf(self, op: Op) -> torch.Tensor:
        return self._binary(op, torch.fmax)

    def _op_arith_minnumf(self, op: Op) -> torch.Tensor:
        return self._binary(op, torch.fmin)

    def _op_arith_negf(self, op: Op) -> torch.Tensor:
        (value,) = self._args(op)
        return torch.neg(value)

    def _op_math_absf(self, op: Op) -> torch.Tensor:
        (value,) = self._args(op)
        return torch.abs(value)

    def _op_math_exp(self, op: Op) -> torch.Tensor:
        (value,) = self._args(op)
        return torch.exp(value)

    def _op_arith_cmpi(self, op: Op) -> torch.Tensor:
        predicate = op.text.split(",")[0].strip()
        a, b = self._args(op)
        return CMP[predicate](a, b)

    def _op_arith_cmpf(self, op: Op) -> torch.Tensor:
        return self._op_arith_cmpi(op)

    def _op_arith_select(self, op: Op) -> torch.Tensor:
        condition, a, b = self._args(op)
        return torch.where(condition, a, b)

    def _convert(self, op: Op) -> tuple[torch.Tensor, torch.dtype]:
        (value,) = self._args(op)
        _, (result,) = op.types
        return value, TORCH_TYPES[result.element]

    def _op_arith_extsi(self, op: Op) -> torch.Tensor:
        value, dtype = self._convert(op)
        return value.to(dtype)

    def _op_arith_extui(self, op: Op) -> torch.Tensor:
        value, dtype = self._convert(op)
        if value.dtype == torch.bool:
            return value.to(dtype)
        return value.view(UNSIGNED[value.dtype]).to(dtype)

    def _op_arith_trunci(self, op: Op) -> torch.Tensor:
        value, dtype = self._convert(op)
        bits = 8 * torch.empty((), dtype=dtype).element_size()
        low = value.long() & ((1 << bits) - 1)
        return torch.where(low >= 1 << (bits - 1), low - (1 << bits), low).to(dtype)

    def _op_arith_truncf(self, op: Op) -> torch.Tensor:
        value, dtype = self._convert(op)
        return value.to(dtype)  # round to nearest even

    def _op_tt_fp_to_fp(self, op: Op) -> torch.Tensor:
        """Float conversions Triton writes as ``tt.fp_to_fp`` (those to and from float8): to
        e4m3 only with round to nearest even, saturating finite values at +-448 as sm_90's
        ``cvt.rn.satfinite.e4m3x2.f32`` does; widening ones exactly."""
        value, dtype = self._convert(op)
        if dtype == torch.float8_e4m3fn:
            if "rounding = rtne" not in op.text:
                raise NotImplementedError(f"tt.fp_to_fp to e4m3 without rtne: {op.text[:120]}")
            value = torch.where(value.isnan(), value, value.clamp(-448.0, 448.0))
        return value.to(dtype)

    def _op_arith_extf(self, op: Op) -> torch.Tensor:
        value, dtype = self._convert(op)
        return value.to(dtype)

    def _op_tt_bitcast(self, op: Op) -> torch.Tensor | Pointer:
        _, (result,) = op.types
        if result.element.startswith("!tt.ptr<"):  # a pointer to other elements: the same bytes
            (pointer,) = self._args(op)
            dtype = TORCH_TYPES[result.pointee]
            ratio = dtype.itemsize // pointer.buffer.dtype.itemsize
            if ratio < 1 or (pointer.offsets % ratio != 0).any():
                raise NotImplementedError(f"{op.text}: only to wider elements at their alignment")
            return Pointer(pointer.buffer.view(dtype), pointer.offsets // ratio)
        value, dtype = self._convert(op)
        return value.view(dtype)

    def _op_arith_sitofp(self, op: Op) -> torch.Tensor:
        value, dtype = self._convert(op)
        return value.to(dtype)

    def _op_arith_fptosi(self, op: Op) -> torch.Tensor:
        """Float to signed integer, rounding toward zero (``cvt.rzi``); a value outside the
        integer's range (LLVM's poison; sm_90 saturates) is refused rather than guessed."""
        value, dtype = self._convert(op)
        limits = torch.iinfo(dtype)
        if bool(((value < limits.min) | (value > limits.max) | value.isnan()).any()):
            raise NotImplementedError(f"arith.fptosi of a value outside {dtype}: {op.text[:120]}")
        return value.to(dtype)

    # -- memory -----------------------------------------------------------------------------
    def _op_tt_addptr(self, op: Op) -> Pointer:
        pointer, offset = self._args(op)
        return Pointer(pointer.buffer, pointer.offsets + offset.to(torch.int64))

    @staticmethod
    def _typed(buffer: torch.Tensor, element: str) -> torch.Tensor:
        dtype = TORCH_TYPES[element]
        if buffer.dtype == dtype:
            return buffer
        if buffer.element_size() != dtype.itemsize:
            raise TypeError(f"a {buffer.dtype} buffer is read as {element}")
        return buffer.view(dtype)

    @staticmethod
    def _check_bounds(pointer: Pointer, mask: torch.Tensor | None, what: str) -> torch.Tensor:
        offsets = pointer.offsets
        active = torch.ones_like(offsets, dtype=torch.bool) if mask is None else mask.expand(offsets.shape)
        outside = active & ((offsets < 0) | (offsets >= pointer.buffer.numel()))
        if bool(outside.any()):
            bad = offsets[outside]
            raise IndexError(
                f"{what} outside its buffer of {pointer.buffer.numel()} elements: offsets "
                f"{bad.min().item()}..{bad.max().item()} ({int(outside.sum())} lanes)"
            )
        return active

    def _read(
        self, pointer: Pointer, mask: torch.Tensor | None, other: Any, element: str, what: str
    ) -> torch.Tensor:
        """The values a load of ``pointer`` (pointee type ``element``) reads; counts them."""
        buffer = self._typed(pointer.buffer, element)
        active = self._check_bounds(pointer, mask, what)
        key = buffer.untyped_storage().data_ptr()
        self.accesses.reads[key] = self.accesses.reads.get(key, 0) + int(active.sum())
        if not self.waited and bool(active.any()):
            self.accesses.read_before_wait.add(key)
        Accesses.mark(self.accesses.read, buffer, pointer.offsets[active])
        safe = torch.where(active, pointer.offsets, torch.zeros_like(pointer.offsets))
        values = buffer[safe]
        if mask is not None:
            fill = other if other is not None else torch.zeros((), dtype=buffer.dtype)
            values = torch.where(active, values, fill.to(buffer.dtype))
        return values

    def _op_tt_load(self, op: Op) -> torch.Tensor:
        args = self._args(op)
        pointer, mask, other = [*args, None, None][:3]
        (pointer_type,), _ = op.types
        return self._read(pointer, mask, other, pointer_type.pointee, f"load {op.results[0]}")

    def _op_tt_store(self, op: Op) -> None:
        args = self._args(op)
        pointer, value, mask = [*args, None][:3]
        (pointer_type, *_), _ = op.types
        buffer = self._typed(pointer.buffer, pointer_type.pointee)
        active = self._check_bounds(pointer, mask, "store")
        value = value.expand(pointer.offsets.shape).to(buffer.dtype)
        offsets = pointer.offsets[active]
        key = buffer.untyped_storage().data_ptr()
        if not self.waited and offsets.numel():
            self.accesses.stored_before_wait.add(key)
        if key not in self.writers:
            self.writers[key] = torch.full((buffer.numel(),), -1, dtype=torch.int64)
        writer = self.writers[key]
        me = (self.program_id[2] * 65536 + self.program_id[1]) * 65536 + self.program_id[0]
        earlier = writer[offsets]
        if bool(((earlier >= 0) & (earlier != me)).any()):
            raise IndexError(f"program {self.program_id} stores to elements another program stored to")
        writer[offsets] = me
        buffer[offsets] = value[active]

    # -- shared memory and cp.async ---------------------------------------------------------
    def _op_ttg_local_alloc(self, op: Op) -> torch.Tensor:
        match = re.search(r"-> !ttg\.memdesc<((?:\d+x)+)(\w+)", op.text)
        if match is None or self._args(op):
            raise NotImplementedError(f"ttg.local_alloc of {op.text[:120]}")
        shape = [int(d) for d in match.group(1).rstrip("x").split("x")]
        dtype = TORCH_TYPES[match.group(2)]
        garbage = torch.full(shape, 0x5A5A5A5A if not dtype.is_floating_point else float("nan"))
        return garbage.to(dtype)

    def _op_ttg_memdesc_index(self, op: Op) -> torch.Tensor:
        memory, index = self._args(op)
        return memory[int(index)]  # a view: copies into it land in the allocation

    def _op_ttg_memdesc_subslice(self, op: Op) -> torch.Tensor:
        """``%m[o0, o1, ...] : memdesc<A> -> memdesc<B, ...>``: the ``B``-shaped block at those
        offsets, a view (copies into the allocation show through)."""
        (memory,) = self._args(op)
        offsets = [int(o) for o in re.search(r"\[([\d, ]+)\]", op.text).group(1).split(",")]  # type: ignore[union-attr]
        shape = re.search(r"-> !ttg\.memdesc<((?:\d+x)+)", op.text).group(1).rstrip("x").split("x")  # type: ignore[union-attr]
        view = memory
        for dim, (start, length) in enumerate(zip(offsets, shape, strict=True)):
            view = view.narrow(dim, start, int(length))
        return view

    def _op_ttg_memdesc_reshape(self, op: Op) -> torch.Tensor:
        """``memdesc_reshape``: the same elements in row-major order under the result's shape, a
        view (copies into it land in the allocation; on a GPU the swizzle follows the address)."""
        (memory,) = self._args(op)
        shape = re.search(r"-> !ttg\.memdesc<((?:\d+x)+)", op.text).group(1).rstrip("x").split("x")  # type: ignore[union-attr]
        return memory.view([int(d) for d in shape])

    def _op_ttg_memdesc_reinterpret(self, op: Op) -> torch.Tensor:
        """``memdesc_reinterpret``: the same bytes as the result's element type and shape (little
        endian, row-major), a view (copies into the allocation show through). On a GPU the
        swizzle of both layouts follows the byte address, so element ``i`` of the result holds
        the bytes it holds here."""
        (memory,) = self._args(op)
        match = re.search(r"-> !ttg\.memdesc<((?:\d+x)+)(\w+)", op.text)
        if match is None or not memory.is_contiguous():
            raise NotImplementedError(f"ttg.memdesc_reinterpret of {op.text[:120]}")
        shape = [int(d) for d in match.group(1).rstrip("x").split("x")]
        return memory.view(TORCH_TYPES[match.group(2)]).view(shape)

    def _op_ttg_async_copy_global_to_local(self, op: Op) -> None:
        pointer, memory, *mask = self._args(op)
        element = re.search(r"!tt\.ptr<(\w+)>", op.text).group(1)  # type: ignore[union-attr]
        active = mask[0] if mask else None
        values = self._read(pointer, active, None, element, f"async copy {op.results[0]}")
        self.open_copies.append((memory, values.view(memory.dtype)))

    def _op_ttg_async_commit_group(self, op: Op) -> None:
        self.copy_groups.append(self.open_copies)
        self.open_copies = []

    def _op_ttg_async_wait(self, op: Op) -> None:
        outstanding = int(_attribute(op, "num").split(":")[0])
        while len(self.copy_groups) > outstanding:
            for memory, values in self.copy_groups.pop(0):
                memory.copy_(values)

    def _op_ttg_local_load(self, op: Op) -> torch.Tensor:
        (memory,) = self._args(op)
        return memory.clone()

    def _op_ttg_local_store(self, op: Op) -> None:
        value, memory = self._args(op)
        memory.copy_(value)

    def _op_ttg_memdesc_trans(self, op: Op) -> torch.Tensor:
        (memory,) = self._args(op)
        order = [int(i) for i in re.search(r"order = array<i32: ([\d, ]+)>", op.text).group(1).split(",")]  # type: ignore[union-attr]
        return memory.permute(order)  # a view: later stores to the allocation show through

    def _op_ttng_fence_async_shared(self, op: Op) -> None:
        """Orders this program's shared-memory stores before its wgmmas' reads: the interpreter's
        reads happen at the wait anyway (see :meth:`_op_ttng_warp_group_dot`)."""

    # -- warp specialization and mbarriers ---------------------------------------------------
    def _op_ttg_warp_specialize(self, op: Op) -> Any:
        """Run the default region and every worker partition (module docstring), workers first;
        returns what the default region yields."""
        if self.scheduler is not None:
            raise NotImplementedError("ttg.warp_specialize inside a partition")
        operands = self._args(op)
        workers = list(range(1, len(op.regions)))
        order = [0, *workers] if self.kernel.default_partition_first else [*workers, 0]
        scheduler = _Scheduler(len(op.regions), order)
        partitions, bodies = [], []
        for index, (header, *region) in enumerate(op.regions):
            partition = copy.copy(self)
            partition.values = dict(self.values)
            partition.open_copies, partition.copy_groups, partition.pending_dots = [], [], []
            partition.scheduler, partition.index, partition.yielded = scheduler, index, []
            if header != "default":
                names = re.findall(r"(%[\w\-.]+):", header)
                partition.values.update(zip(names, operands, strict=True))
                partition.warps = int(re.search(r"num_warps\((\d+)\)", header).group(1))  # type: ignore[union-attr]
            partitions.append(partition)
            bodies.append(functools.partial(partition._run_partition, region))
        scheduler.run(bodies)
        for partition in partitions:
            if partition.open_copies or partition.copy_groups:
                raise RuntimeError(
                    f"partition {partition.index} ended with cp.async copies that never landed"
                )
        results = partitions[0].yielded
        return results if len(results) != 1 else results[0]

    def _run_partition(self, region: list[Any]) -> None:
        for inner in region:
            if inner.name in ("ttg.warp_yield", "ttg.warp_return"):
                self.yielded = self._args(inner)
                return
            self._execute(inner)

    def _barrier(self, memory: torch.Tensor) -> _Barrier:
        barrier = self.barriers.get(memory.data_ptr())
        if barrier is None:
            raise RuntimeError("an mbarrier used before ttng.init_barrier")
        return barrier

    def _op_ttng_init_barrier(self, op: Op) -> None:
        (memory,) = self._args(op)
        count = int(re.match(r"\s*%[\w\-.#]+, (\d+)", op.text).group(1))  # type: ignore[union-attr]
        self.barriers[memory.data_ptr()] = _Barrier(count, count)

    def _op_ttng_wait_barrier(self, op: Op) -> None:
        memory, parity, *rest = self._args(op)
        if rest and rest[0].dtype == torch.bool and not bool(rest[0]):
            return
        barrier, parity = self._barrier(memory), int(parity) & 1
        what = f"the phase of parity {parity} of the mbarrier at shared offset {memory.data_ptr() % 4096:#x}"
        if self.scheduler is None:
            if not barrier.phase_done(parity):
                raise Deadlock(f"a program without partitions waits forever for {what}")
            return
        self.scheduler.wait_until(self.index, lambda: barrier.phase_done(parity), what)

    def _op_ttng_arrive_barrier(self, op: Op) -> None:
        """One arrival of ``count`` for the partition (Triton: a barrier of the partition's warps,
        then one thread arrives)."""
        memory, *predicate = self._args(op)
        count = int(re.match(r"\s*%[\w\-.#]+, (\d+)", op.text).group(1))  # type: ignore[union-attr]
        if not predicate or bool(predicate[0]):
            self._barrier(memory).arrive(count)
            if self.scheduler is not None:
                self.scheduler.preempt(self.index)

    def _op_ttng_async_copy_mbarrier_arrive(self, op: Op) -> None:
        """``cp.async.mbarrier.arrive.noinc``: every thread of the partition arrives once its
        earlier copies land; those copies land when the barrier's phase completes."""
        if "noIncrement" not in op.text:
            raise NotImplementedError("ttng.async_copy_mbarrier_arrive without noIncrement")
        if self.copy_groups:
            raise NotImplementedError("cp.async copies tracked by both commit groups and an mbarrier")
        (memory,) = self._args(op)
        barrier = self._barrier(memory)
        barrier.copies += self.open_copies
        self.open_copies = []
        barrier.arrive(self.warps * 32)
        if self.scheduler is not None:
            self.scheduler.preempt(self.index)

    def _op_ttng_barrier_expect(self, op: Op) -> None:
        """``mbarrier.arrive.expect_tx`` (Triton's lowering of ``mbarrier.expect``): one arrival
        that expects the op's byte count of TMA copies in the current phase."""
        memory, *predicate = self._args(op)
        nbytes = int(re.match(r"\s*%[\w\-.#]+, (\d+)", op.text).group(1))  # type: ignore[union-attr]
        if not predicate or bool(predicate[0]):
            self._barrier(memory).arrive(1, nbytes)
            if self.scheduler is not None:
                self.scheduler.preempt(self.index)

    def _op_ttng_async_tma_copy_global_to_local(self, op: Op) -> None:
        """A TMA load (``cp.async.bulk.tensor``): the descriptor's box at the coordinates (its
        rows and columns outside the tensor read as zeros), in flight on the mbarrier until a
        wait observes its phase complete (:class:`_Barrier`)."""
        descriptor, *rest = self._args(op)
        rank = len(descriptor.block_shape)
        coordinates, (memory, barrier_memory, *predicate) = rest[:rank], rest[rank:]
        if predicate and not bool(predicate[0]):
            return
        source = descriptor.base.as_strided(list(descriptor.shape), list(descriptor.strides))
        box = torch.zeros(list(descriptor.block_shape), dtype=source.dtype)
        inside, taken = [], []
        for start, size, extent in zip(
            (int(c) for c in coordinates), descriptor.block_shape, descriptor.shape, strict=True
        ):
            low, high = max(start, 0), min(start + size, extent)
            inside.append(slice(low, max(high, low)))
            taken.append(slice(low - start, max(high, low) - start))
        box[tuple(taken)] = source[tuple(inside)]
        nbytes = box.numel() * box.element_size()
        self._barrier(barrier_memory).transfer(memory, box.view(memory.dtype), nbytes)
        if self.scheduler is not None:
            self.scheduler.preempt(self.index)

    def _op_gpu_barrier(self, op: Op) -> None:
        """A CTA barrier (``gpu.barrier`` in Triton 3.6, ``ttg.barrier`` later): a program is one
        sequential run here."""

    _op_ttg_barrier = _op_gpu_barrier

    # -- matrix product, reductions, inline assembly ---------------------------------------
    def _op_ttng_warp_group_dot(self, op: Op) -> Any:
        """A wgmma: operands from shared memory (views) or registers, fp32 accumulator. An
        asynchronous one reads its shared operands as late as the program allows, at the
        ``warp_group_dot_wait`` that retires it: a program that rewrites an operand's buffer
        before that wait gets the wrong product, as it may on a GPU."""
        a, b, c, *use = self._args(op)
        dot = _PendingDot(a, b, c, bool(use[0]) if use else True)
        if "isAsync = true" not in op.text:
            return dot.result()
        self.pending_dots.append(dot)
        return dot

    def _op_ttng_warp_group_dot_wait(self, op: Op) -> Any:
        pendings = int(_attribute(op, "pendings").split(":")[0])
        while len(self.pending_dots) > pendings:
            self.pending_dots.pop(0).result()
        retired = [isinstance(d, _PendingDot) and d.done is not None for d in self._args(op)]
        deps = [d.result() if done else d for d, done in zip(self._args(op), retired, strict=True)]
        return deps if len(deps) > 1 else deps[0]

    def _op_tt_dot(self, op: Op) -> torch.Tensor:
        a, b, c = self._args(op)[:3]
        return (torch.matmul(a.double(), b.double()) + c.double()).float()

    def _op_tt_reduce(self, op: Op) -> torch.Tensor:
        (value,) = self._args(op)
        axis = int(_attribute(op, "axis").split(":")[0])
        region = op.regions[0]
        (label, *body) = region  # the block label carries the arguments: ^bb0(%a: f32, %b: f32)
        arguments = re.findall(r"(%[\w\-.]+):", label) if isinstance(label, str) else []
        if len(arguments) != 2:
            raise NotImplementedError("tt.reduce of one tensor with a two-argument combiner only")
        result = value.select(axis, 0)
        for i in range(1, value.shape[axis]):
            self.values[arguments[0]], self.values[arguments[1]] = result, value.select(axis, i)
            for inner in body:
                if inner.name == "tt.reduce.return":
                    (result,) = self._args(inner)
                    break
                self._execute(inner)
        return result

    def _op_tt_elementwise_inline_asm(self, op: Op) -> Any:
        asm = re.match(r'\s*"((?:[^"\\]|\\.)*)"', op.text).group(1)  # type: ignore[union-attr]
        asm = re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), asm)
        constraints = re.search(r'constraints = "([^"]*)"', op.text).group(1).split(",")  # type: ignore[union-attr]
        pack = int(_attribute(op, "packed_element").split(":")[0])
        inputs = self._args(op)
        if not inputs:  # ``-> i32``: no signature to parse
            return self._grid_dependency(asm)
        _, result_types = op.types
        if len(inputs) == 1 and isinstance(inputs[0], Pointer):
            return self._l2_prefetch(asm, inputs[0], result_types[0].shape)
        if pack == 1:
            return self._inline_asm_elementwise(asm, constraints, inputs, result_types)
        return self._inline_asm_packed(asm, pack, inputs, result_types)

    def _inline_asm_elementwise(
        self, asm: str, constraints: list[str], inputs: list[Any], result_types: list[Type]
    ) -> Any:
        """One asm execution per element: operand ``$N`` is one element's bits."""
        outputs = [c for c in constraints if c.startswith("=")]
        operands = {}
        for index, value in enumerate(inputs):
            bits = value.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[value.element_size()])
            operands[len(outputs) + index] = bits.long() & ((1 << (8 * value.element_size())) - 1)
        executed = ptx_subset.run(asm, operands)
        results = []
        for index, (constraint, result) in enumerate(zip(outputs, result_types, strict=True)):
            bits = torch.as_tensor(executed[index]).expand(result.shape)
            width = {"=r": torch.int32, "=h": torch.int16}[constraint]
            results.append(bits.to(width).view(TORCH_TYPES[result.element]))
        return results if len(results) > 1 else results[0]

    def _inline_asm_packed(self, asm: str, pack: int, inputs: list[Any], result_types: list[Type]) -> Any:
        """One asm execution per ``pack`` consecutive elements of the last axis (the elements
        Triton packs into a thread's registers), every operand and result 32-bit registers:
        ``pack * element bytes / 4`` of them each, outputs numbered first, little-endian."""

        def registers(value: torch.Tensor) -> list[torch.Tensor]:
            if value.shape[-1] % pack:
                raise NotImplementedError(f"inline asm: last axis {value.shape[-1]} not a multiple of {pack}")
            raw = value.contiguous().view(torch.uint8).reshape(-1, pack * value.element_size()).long()
            if raw.shape[1] % 4:
                raise NotImplementedError("inline asm: packed operands of whole 32-bit registers only")
            words = raw.reshape(raw.shape[0], -1, 4)
            packed = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24
            return list(packed.unbind(1))

        sizes = [torch.empty((), dtype=TORCH_TYPES[r.element]).element_size() for r in result_types]
        counts = [pack * size // 4 for size in sizes]
        operands: dict[int, Any] = {}
        number = sum(counts)
        for value in inputs:
            for word in registers(value):
                operands[number] = word
                number += 1
        executed = ptx_subset.run(asm, operands)
        results, number = [], 0
        for count, result in zip(counts, result_types, strict=True):
            words = torch.stack([torch.as_tensor(executed[number + i]) for i in range(count)], 1)
            number += count
            raw = torch.stack([(words >> shift) & 0xFF for shift in (0, 8, 16, 24)], -1).to(torch.uint8)
            results.append(raw.reshape(-1).view(TORCH_TYPES[result.element]).reshape(result.shape))
        return results if len(results) > 1 else results[0]

    def _grid_dependency(self, asm: str) -> torch.Tensor:
        """An inline asm without operands (a scalar result): only
        ``griddepcontrol.launch_dependents`` and ``griddepcontrol.wait`` (and the dummy result
        ``$0 = 0``) are known."""
        instruction, *rest = _statements(asm)
        if rest != ["mov.b32 $0, 0"] or instruction not in (
            "griddepcontrol.launch_dependents",
            "griddepcontrol.wait",
        ):
            raise NotImplementedError(f"inline asm without operands: {asm!r}")
        if instruction == "griddepcontrol.wait":
            self.waited = True
        return torch.zeros((), dtype=torch.int32)

    def _l2_prefetch(self, asm: str, pointer: Pointer, shape: tuple[int, ...]) -> torch.Tensor:
        """An inline asm of one pointer operand: only ``prefetch.global.L2 [$1]`` (and the dummy
        result ``$0 = 0``) is known. Checks the addresses, marks them, returns the zeros."""
        if _statements(asm) != ["prefetch.global.L2 [$1]", "mov.b32 $0, 0"]:
            raise NotImplementedError(f"inline asm with a pointer operand: {asm!r}")
        self._check_bounds(pointer, None, "L2 prefetch")
        Accesses.mark(self.accesses.prefetched, pointer.buffer, pointer.offsets.reshape(-1))
        return torch.zeros(shape, dtype=torch.int32)

    # -- loops and branches -----------------------------------------------------------------
    def _op_scf_if(self, op: Op) -> Any:
        """``scf.if``: the program's scalar condition picks the then or the else region, whose
        ``scf.yield`` gives the results."""
        condition = bool(self.values[op.operands[0]])
        region = op.regions[0] if condition else (op.regions[1] if len(op.regions) > 1 else [])
        results: list[Any] = []
        for inner in region:
            if inner.name == "scf.yield":
                results = self._args(inner)
                break
            self._execute(inner)
        return results if len(results) != 1 else results[0]

    def _op_scf_for(self, op: Op) -> Any:
        value = r"(%[\w\-.#]+)"
        match = re.match(rf"\s*{value} = {value} to {value} step {value}(?: iter_args\((.*?)\))?", op.text)
        if match is None:
            raise ValueError(f"cannot parse scf.for {op.text[:200]}")
        induction, lower, upper, step, iter_args = match.groups()
        carried = [tuple(p.strip() for p in pair.split(" = ")) for pair in _split_top(iter_args or "")]
        state = [self.values[init] for _, init in carried]
        for i in range(int(self.values[lower]), int(self.values[upper]), int(self.values[step])):
            self.values[induction] = torch.tensor(i, dtype=torch.int32)
            for (name, _), value in zip(carried, state, strict=True):
                self.values[name] = value
            for inner in op.regions[0]:
                if inner.name == "scf.yield":
                    state = self._args(inner)
                    break
                self._execute(inner)
        return state if len(state) != 1 else state[0]
