"""Humming's NVFP4 MoE on the package's weights: the W4A16 kernel vLLM 0.32+ serves ModelOpt NVFP4
experts with on Hopper (its SM90 default, ahead of Marlin), as a benchmark baseline (a helper of
``bench_moe.py``; needs CUDA, sm_90 and the standalone ``humming-kernels`` 0.1.19).

vLLM 0.33 itself cannot run beside torch 2.11 (it pins torch 2.14), so this calls humming's own
APIs and does vLLM's few glue steps itself, as read in vLLM 0.33 (docs/humming.md, section 1):

* once: ``ModeloptNvfp4WeightSchema.convert_humming`` per GEMM (w13 as two ``[I, I]`` stacks; the
  codes are only viewed as int32, the per-expert global scales fold to one fp32 per expert when
  gate == up, else to a bf16 per-row scale), the W4A16 input schema ``HummingInputSchema()``,
  ``prepare_and_transform_humming_tensors(..., pad_n_to_multiple=256, pad_k_to_multiple=128)``
  (a second, repacked copy of the experts, which is why this is a baseline and not a backend),
  ``get_heuristics_config(..., gemm_type=INDEXED)`` and the stream-K locks (``8 * SMs`` int32);
* per call, as ``HummingIndexedExperts.apply``: the routing in vLLM's ``moe_align_block_size``
  format with the M tile of the w13 interval holding ``T * k`` routes (aligned again for w2 only
  if its tile M differs); ``humming_forward`` for w13 (indexed, ``top_k = k``); the activation
  ``may_process_input(..., activation_type="binary_split", activation_impl="(a / (1.f +
  expf(-a))) * b")``, SiLU(gate) * up; ``humming_forward`` for w2 (``top_k = 1``); then the
  router-weighted top-k sum, which vLLM runs separately too (``moe_fused_mul_sum``, an fp32 sum
  of ``w_k * y_k``): here plain torch, ``(y.view(T, k, H).float() * w[..., None]).sum(1)``, the
  same numerics, a few extra small kernels inside the timed graph (fair enough at these sizes).

The alignment is vLLM 0.26's ``moe_align_block_size`` CUDA op (the op vLLM 0.33 calls) where
vLLM is importable, else :func:`align_block_size`, a capture-safe torch equivalent (slower).

Kernel compilation (humming JITs with NVRTC, one process per kernel; ``HUMMING_CACHE_DIR`` sets
its cubin cache): humming compiles every tile of a tuning list, in parallel, at the list's first
call. vLLM passes the whole heuristic list (15 to 19 tiles per GEMM for the benchmark's shapes).
Here the first call compiles, for both GEMMs at once, only the tiles of the heuristic intervals
holding ``t * k`` routes for the token counts ``t`` of ``token_counts`` (default: bench_moe.py's
``TOKENS``) and of that call (5 or 6 tiles per GEMM); then each call passes a one-interval list
``(0, 2**30] -> tile``, the tile of the interval holding its ``T * k`` (the tile vLLM picks for
that size; humming reuses the compiled kernel). The interval is widened because humming's
launcher also looks the list up at ``shape_m = 1``, for the layer's base kernel data. A token
count outside ``token_counts`` compiles its tiles at its own first call. After the first call of
a size the callable is CUDA-graph capturable (no compile, no host sync, no allocation outside
torch's allocator).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

MODELOPT_NVFP4 = {"quant_method": "modelopt", "quant_algo": "nvfp4"}
COMPUTE_CONFIG = {"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "indexed"}
SILU_AND_MUL = "(a / (1.f + expf(-a))) * b"  # vLLM 0.33 humming/activation.py, MoEActivation.SILU
PAD_N, PAD_K = 256, 128  # vLLM 0.33 humming/moe.py, _prepare_and_transform_sublayer
WHOLE_RANGE = 1 << 30  # the last heuristic interval's upper bound (humming tune/base.py)
BENCH_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 8192, 16384)  # bench_moe.TOKENS

Alignment = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> Alignment:
    """vLLM's ``moe_align_block_size`` format in torch, capture-safe (no host reads).

    Returns ``sorted_ids`` int32: the route ids ``token * k + slot`` grouped by expert (in route
    order), each expert's group padded to a multiple of ``block_size`` with the pad value
    ``T * k``; the buffer is ``T * k + E * (block_size - 1)`` long (``min`` with
    ``T * k * block_size``), and past ``num_tokens_padded`` it holds the pad value. ``expert_ids``
    int32: the expert of each block, -1 past the last used block. ``num_tokens_padded``: int32
    ``[1]``, the padded route count. ``topk_ids`` must be in ``[0, E)`` (no expert parallelism).
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    routes = flat.numel()
    capacity = routes + num_experts * (block_size - 1)
    if routes < num_experts:
        capacity = min(capacity, routes * block_size)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_size - 1) // block_size * block_size
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(routes, device=device) - (counts.cumsum(0) - counts)[expert]
    sorted_ids = torch.full((capacity,), routes, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, (padded_end - padded)[expert] + rank, order.to(torch.int32))
    block_start = torch.arange(0, capacity, block_size, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, expert_ids, padded_end[-1:].to(torch.int32)


def vllm_alignment(device: torch.device) -> Callable[[torch.Tensor, int, int], Alignment] | None:
    """vLLM's ``moe_align_block_size`` (0.26's module path, also 0.33's), or ``None`` where it is
    not importable or its op does not run on ``device`` (a CPU build of vLLM imports but has no op;
    tried once here, outside any capture)."""
    try:
        from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
    except Exception:  # not installed, or an install that does not import
        return None

    def align(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> Alignment:
        sorted_ids, expert_ids, num_tokens_padded = moe_align_block_size(
            topk_ids=topk_ids, block_size=block_size, num_experts=num_experts
        )[:3]
        return sorted_ids, expert_ids, num_tokens_padded

    try:
        align(torch.zeros(4, 2, dtype=torch.int32, device=device), 16, 4)
    except Exception:
        return None
    return align


def interval_tile(tuning: list[Any], routes: int) -> dict[str, Any]:
    """The tile config of the heuristic interval ``(low, high]`` holding ``routes``, as vLLM's
    ``HummingIndexedExperts.prepare_humming_moe_kwargs`` looks it up."""
    for low, high, config in tuning:
        if low < routes <= high:
            return config
    raise ValueError(f"no humming tuning interval holds {routes} routes")


def pruned_tuning(tuning: list[Any], routes: Sequence[int]) -> list[Any]:
    """The heuristic intervals holding any of ``routes``, in their order."""
    return [entry for entry in tuning if any(entry[0] < count <= entry[1] for count in routes)]


def one_interval(config: dict[str, Any]) -> str:
    """A tuning list with one tile over every size (see the module docstring), as JSON."""
    return json.dumps([[0, WHOLE_RANGE, config]])


def on_sm90(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA GPU of compute capability 9.0 (the tiles below are SM90's)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def humming_moe(
    weights: Any, token_counts: Sequence[int] = BENCH_TOKENS, use_vllm_alignment: bool = True
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``fn(hidden [T, H] bf16, topk_weights [T, k], topk_ids [T, k]) -> [T, H] bf16`` over
    humming-repacked copies of ``weights`` (:class:`a4prefill.ops.modelopt.NvFp4MoEWeights` on
    CUDA); ``None`` when ``humming`` is not importable here or the GPU is not sm_90.

    The first call compiles the tiles of ``token_counts`` (module docstring). The routing uses
    vLLM's alignment op where it runs and ``use_vllm_alignment``, else :func:`align_block_size`;
    ``fn.alignment`` says which (``"vllm"`` or ``"torch"``). ``fn.tiles`` records the
    ``block_shape`` of each GEMM per token count called."""
    try:
        from humming.config import GemmType
        from humming.forward import humming_forward, may_process_input
        from humming.kernel.humming import HummingKernel
        from humming.schema import BaseWeightSchema, HummingInputSchema
        from humming.transform import prepare_and_transform_humming_tensors
        from humming.tune import get_heuristics_config
    except ImportError:
        return None
    device = weights.w13_weight.device
    if not on_sm90(device):
        return None

    experts, two_inter, hidden_half = weights.w13_weight.shape
    hidden, inter = 2 * hidden_half, two_inter // 2
    weight_schema = BaseWeightSchema.from_config(MODELOPT_NVFP4)
    sublayers: dict[str, tuple[Any, dict[str, torch.Tensor], list[Any]]] = {}
    for name, shape_n, shape_k, n_stacks in (
        ("w13", two_inter, hidden, [inter, inter]),
        ("w2", hidden, inter, [hidden]),
    ):
        tensors = {
            "weight": getattr(weights, f"{name}_weight"),
            "weight_scale": getattr(weights, f"{name}_weight_scale"),
            "weight_scale_2": getattr(weights, f"{name}_weight_scale_2"),
        }
        stacks: dict[str, Any] = {
            "shape_n_stacks": n_stacks,
            "shape_k_stacks": [shape_k],
            "param_dtype": torch.bfloat16,
            "num_experts": experts,
        }
        schema, converted = weight_schema.convert_humming(tensors=tensors, **stacks)
        input_schema, input_tensors = HummingInputSchema().convert_humming(tensors=tensors, **stacks)
        converted.update(input_tensors)  # none for W4A16
        if not input_schema.is_compatible_with(schema, torch.bfloat16):
            raise RuntimeError(f"humming refuses W4A16 for {schema}")
        config, prepared = prepare_and_transform_humming_tensors(
            tensors=converted,
            shape_n=shape_n,
            shape_k=shape_k,
            pad_n_to_multiple=PAD_N,
            pad_k_to_multiple=PAD_K,
            input_schema=input_schema,
            weight_schema=schema,
            has_bias=False,
            num_experts=experts,
            torch_dtype=torch.bfloat16,
            device=device,
        )
        tuning = get_heuristics_config(
            layer_config=config,
            use_f16_accum=False,
            use_batch_invariant=False,
            gemm_type=GemmType.INDEXED,
        )
        sublayers[name] = (config, prepared, tuning)
    config13, tensors13, tuning13 = sublayers["w13"]
    config2, tensors2, tuning2 = sublayers["w2"]
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    locks = torch.zeros(sms * 8, dtype=torch.int32, device=device)  # vLLM's create_humming_locks
    compute_config = json.dumps(COMPUTE_CONFIG)
    vllm_align = vllm_alignment(device) if use_vllm_alignment else None
    align = vllm_align or align_block_size
    device_index = device.index if device.index is not None else torch.cuda.current_device()
    plans: dict[int, tuple[int, int, str, str]] = {}
    tiles: dict[int, dict[str, list[int]]] = {}
    compiled_top_k: set[int] = set()

    def compile_tiles(tokens: int, top_k: int) -> None:
        """Both GEMMs' tiles for ``token_counts`` and ``tokens``, compiled in parallel (humming
        reuses these kernels for the one-interval lists of the calls)."""
        routes = sorted({count * top_k for count in (*token_counts, tokens)})
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(
                    HummingKernel.prepare_kernels,
                    config.to_str(),
                    compute_config,
                    json.dumps(pruned_tuning(tuning, routes)),
                    device_index,
                )
                for config, tuning in ((config13, tuning13), (config2, tuning2))
            ]
            for future in futures:
                future.result()
        compiled_top_k.add(top_k)

    def plan(tokens: int, top_k: int) -> tuple[int, int, str, str]:
        routes = tokens * top_k
        if routes not in plans:  # host-only work, done at the first (warm-up) call of a size
            if top_k not in compiled_top_k:
                compile_tiles(tokens, top_k)
            tile13, tile2 = interval_tile(tuning13, routes), interval_tile(tuning2, routes)
            block13, block2 = tile13["block_shape"][0], tile2["block_shape"][0]
            plans[routes] = (block13, block2, one_interval(tile13), one_interval(tile2))
            tiles[tokens] = {"w13": list(tile13["block_shape"]), "w2": list(tile2["block_shape"])}
        return plans[routes]

    def run(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        tokens, top_k = topk_ids.shape
        routes = tokens * top_k
        block13, block2, tile13, tile2 = plan(tokens, top_k)
        ids = topk_ids.to(torch.int32).contiguous()
        routing13 = align(ids, block13, experts)
        routing2 = routing13 if block2 == block13 else align(ids, block2, experts)

        def gemm(
            config: Any,
            inputs: torch.Tensor,
            tensors: dict[str, Any],
            routing: Alignment,
            width: int,
            routes_per_row: int,
            tile: str,
        ) -> torch.Tensor:
            outputs = torch.empty(routes, width, dtype=torch.bfloat16, device=device)
            humming_forward(
                config,
                inputs=inputs,
                weight=tensors["weight"],
                weight_scale=tensors["weight_scale"],
                zero_point=None,
                bias=None,
                weight_scale_2=tensors.get("weight_scale_2"),
                input_scale=None,
                input_scale_2=None,
                outputs=outputs,
                sorted_ids=routing[0],
                expert_ids=routing[1],
                num_tokens_padded=routing[2],
                top_k=routes_per_row,
                tuning_config=tile,
                locks=locks,
                valid_shape_m=routes,
                compute_config=compute_config,
            )
            return outputs

        inputs = hidden_states.to(torch.bfloat16).contiguous()
        gate_up = gemm(config13, inputs, tensors13, routing13, two_inter, top_k, tile13)
        activated = torch.empty(routes, inter, dtype=torch.bfloat16, device=device)
        may_process_input(
            config2,
            inputs=gate_up,
            outputs=activated,
            activation_type="binary_split",
            activation_impl=SILU_AND_MUL,
        )
        down = gemm(config2, activated, tensors2, routing2, hidden, 1, tile2)
        weighted = down.view(tokens, top_k, hidden).float() * topk_weights.float().unsqueeze(-1)
        return weighted.sum(1).to(torch.bfloat16)

    run.alignment = "vllm" if vllm_align is not None else "torch"  # type: ignore[attr-defined]
    run.tiles = tiles  # type: ignore[attr-defined]
    return run


def _self_check(tokens: int) -> None:
    """On the GPU: humming against ``moe_reference`` at ``tokens`` tokens (bench_moe's "small"
    shape and random weights), eager against CUDA-graph replay, and the torch alignment against
    vLLM's op where vLLM is importable."""
    from a4prefill.ops.reference import moe_reference
    from a4prefill.tools.numerics.layer_metrics import relative_error
    from bench_moe import SHAPES, random_routing, random_weights

    shape = SHAPES["small"]
    torch.manual_seed(0)
    weights = random_weights(shape["experts"], shape["hidden"], shape["intermediate"], "cuda")
    fn = humming_moe(weights, token_counts=[tokens])
    if fn is None:
        raise SystemExit("humming is not importable here, or the GPU is not sm_90")
    x, topk_w, topk_ids = random_routing(tokens, shape["hidden"], shape["experts"], shape["top_k"])
    out = fn(x, topk_w, topk_ids).float()
    errors = {}
    for suffix, reference_input in {"": x.float(), "_bf16_io": x}.items():
        expected = moe_reference(reference_input, topk_w, topk_ids, weights.experts(), None).float()
        errors[f"rel_err{suffix}"] = relative_error(out, expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn(x, topk_w, topk_ids)
    graph.replay()
    torch.cuda.synchronize()
    errors["graph_vs_eager"] = relative_error(captured.float(), out)
    vllm_align = vllm_alignment(x.device)
    if vllm_align is not None:
        for block in (8, 16, 24, 48, 64, 80):
            ours = align_block_size(topk_ids, block, shape["experts"])
            theirs = vllm_align(topk_ids.to(torch.int32), block, shape["experts"])
            errors[f"align_{block}_matches_vllm"] = _same_alignment(ours, theirs, block, topk_ids.numel())
        # the torch alignment end to end (bench_moe's path where vLLM is absent), captured too
        fallback = humming_moe(weights, token_counts=[tokens], use_vllm_alignment=False)
        assert fallback is not None and fallback.alignment == "torch"  # type: ignore[attr-defined]
        eager = fallback(x, topk_w, topk_ids)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fallback(x, topk_w, topk_ids)
        graph.replay()
        torch.cuda.synchronize()
        errors["torch_align_vs_vllm_align"] = relative_error(eager.float(), out)
        errors["torch_align_graph_vs_eager"] = relative_error(captured.float(), eager.float())
    print(json.dumps({"alignment": fn.alignment, "tiles": fn.tiles, **errors}))  # type: ignore[attr-defined]
    worst = max(value for key, value in errors.items() if "vs" in key)
    if errors["rel_err_bf16_io"] > 2e-2 or worst > 1e-2 or any(value is False for value in errors.values()):
        raise SystemExit("humming disagrees with the reference, its graph replay or vLLM's alignment")


def _same_alignment(ours: Alignment, theirs: Alignment, block: int, routes: int) -> bool:
    """Equal padded counts, expert per used block and route set per expert (the route order inside
    an expert is free: vLLM's op places routes with atomics)."""
    padded = int(ours[2].item())
    if padded != int(theirs[2].item()) or padded % block:
        return False
    blocks = padded // block
    if not torch.equal(ours[1][:blocks], theirs[1][:blocks]):
        return False
    owner = ours[1][:blocks].long().repeat_interleave(block)
    keys = [(owner * (routes + 1) + ids[:padded].long()).sort().values for ids in (ours[0], theirs[0])]
    return torch.equal(keys[0], keys[1])


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="humming baseline self-check (CUDA, sm_90)")
    parser.add_argument("--tokens", type=int, default=64)
    _self_check(parser.parse_args().tokens)
