"""vLLM's own NVFP4 MoE path, the package's W4A16 and the package's split, side by side (a script).

Usage (a CUDA machine with vLLM; each configuration runs in its own process, one after another):

    PYTHONPATH=src python benchmarks/bench_vllm_paths.py --out DIR [--model large|tiny]
        [--configs bf16,vllm_modelopt_fp4,a4prefill_w4a16,a4prefill_split] [--work DIR]

Re-plot or print a result anywhere: ``--plot DIR/bench_vllm_paths.json``,
``--table DIR/bench_vllm_paths.json``. A configuration whose result is already in ``--work``
is not run again (runs can be spread over several calls of a machine that keeps ``/tmp``).

One random ModelOpt NVFP4 checkpoint (:class:`a4prefill.tools.tiny_model.TinyModelSpec`, every MoE
layer calibrated) and its bf16 copy (:func:`a4prefill.tools.numerics.dequantized_checkpoint.
write_dequantized_checkpoint`: expert weights are the NVFP4 values). Configurations, all with
the same vLLM engine arguments and ``-cc`` (FULL_AND_PIECEWISE, ``max_cudagraph_capture_size=
compile_ranges_endpoints=[64]``, compile caches off):

- ``bf16``: vLLM's unquantized MoE on the bf16 copy (the numerics reference);
- ``vllm_modelopt_fp4``: ``--quantization modelopt_fp4``, vLLM's own path (Marlin W4A16 on
  Hopper; the chosen kernel is read from the engine and saved);
- ``a4prefill_w4a16``: ``--quantization a4prefill_nvfp4`` without the split pass;
- ``a4prefill_split``: the same with the split pass (prefill rows of uncaptured steps A4);
- ``a4prefill_split_a8``: the split with ``prefill_precision: "a8"`` (prefill rows FP8 e4m3
  activations, docs/numerics.md section 8) on the default backend: on an H200 the triton
  backend's A8 kernel (sm_90), CUDA graphs as the others (captured steps W4A16 by the row rule);
  on the CPU the ``reference`` backend;
- ``a4prefill_split_a8_reference``: the same on the ``reference`` backend
  (``A4PREFILL_BACKEND=reference``), which reads expert ids on the host and so cannot be
  captured: without CUDA graphs (``cudagraph_mode: NONE``; every step uncaptured, decode rows
  W4A16 by the row rule). Numerics only (the oracle's prompt logprobs, to compare the kernel's
  with); its tokens/s are plain torch's. Run only when ``--configs`` names it.

Numbers per configuration:

- numerics: the logprob of every prompt token (8 random prompts of 256 token ids, teacher
  forcing, ``prompt_logprobs=0``); the report gives median / p90 / max absolute difference
  against ``bf16`` per prompt token;
- prefill tokens/s: one 8192-token prompt, ``max_tokens=1`` (one engine step), median of 3 after
  a warm-up;
- decode tokens/s at batch 1, 16, 64 (16-token prompts): ``B * 128 / (t(129 tokens) - t(1 token))``,
  best of 3 after a warm-up; every decode step of these batches is a captured FULL graph;
- on CUDA, one prefill and one batch-1 decode under ``torch.profiler``: wall time against GPU
  kernel time (how host-bound the step is), the MoE's GPU time (the kernels
  :func:`is_moe_kernel` names: experts, their routing, permutation and combine) and the kernels
  with the most GPU time.

A configuration that fails (its process exits non-zero) is a row of the table with the reason;
the others are reported and plotted as usual.

The model is random (word-level vocabulary of 512 tokens), so the lm_head is negligible and the
MoE layers dominate; the timings include attention, sampling and the engine's scheduling.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from a4prefill.tools.tiny_model import REAL_SHAPE

CONFIGS: dict[str, dict[str, Any]] = {
    "bf16": {"checkpoint": "bf16", "quantization": None, "split": False},
    "vllm_modelopt_fp4": {"checkpoint": "nvfp4", "quantization": "modelopt_fp4", "split": False},
    "a4prefill_w4a16": {"checkpoint": "nvfp4", "quantization": "a4prefill_nvfp4", "split": False},
    "a4prefill_split": {"checkpoint": "nvfp4", "quantization": "a4prefill_nvfp4", "split": True},
    "a4prefill_split_a8": {
        "checkpoint": "nvfp4",
        "quantization": "a4prefill_nvfp4",
        "split": True,
        "settings": {"prefill_precision": "a8"},
    },
    "a4prefill_split_a8_reference": {
        "checkpoint": "nvfp4",
        "quantization": "a4prefill_nvfp4",
        "split": True,
        "settings": {"prefill_precision": "a8"},
        "environment": {"A4PREFILL_BACKEND": "reference"},  # the A8 oracle
        "cudagraph_mode": "NONE",  # the reference backend is not capture-safe
    },
}
REFERENCE = "bf16"
MODELS: dict[str, dict[str, Any]] = {
    "large": {
        **REAL_SHAPE,
        "num_layers": 4,
        "max_position_embeddings": 16384,
        "uncalibrated_layer": None,
    },
    # a CPU smoke run; intermediate 128 so that A8 (blocks of 128 along H and I) can run
    "tiny": {"max_position_embeddings": 16384, "uncalibrated_layer": None, "moe_intermediate_size": 128},
}
CAPTURE_LIMIT = 64
NUMERICS_PROMPTS, NUMERICS_LENGTH = 8, 256
DECODE_BATCHES, DECODE_TOKENS, DECODE_PROMPT = (1, 16, 64), 128, 16
REPEATS = 3
RESULT_FILE = "bench_vllm_paths.json"


def build_checkpoints(model: str, work: Path) -> tuple[dict[str, Path], bool]:
    """The NVFP4 checkpoint and its bf16 copy under ``work``, reused where they hold this package
    version's recipe of ``model``; and whether they were (re)built (results of older ones are
    stale then)."""
    from a4prefill.tools.numerics.dequantized_checkpoint import write_dequantized_checkpoint
    from a4prefill.tools.tiny_model import TinyModelSpec, ensure_tiny_model_built

    paths = {"nvfp4": work / f"{model}-nvfp4", "bf16": work / f"{model}-bf16"}
    rebuilt = ensure_tiny_model_built(paths["nvfp4"], TinyModelSpec(**MODELS[model]))
    if rebuilt or not (paths["bf16"] / "config.json").exists():
        write_dequantized_checkpoint(paths["nvfp4"], paths["bf16"])
    return paths, rebuilt


def result_path(work: Path, model: str, name: str, prefill_length: int, suffix: str = ".json") -> Path:
    """Where configuration ``name``'s result (or, with ``suffix`` ``.log``, its log) is kept:
    per model and prefill length, so that ``--work`` reuses only results of the same run."""
    return work / f"{model}-p{prefill_length}-{name}{suffix}"


def _token_prompts(count: int, length: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(count)]


def _timed(llm: Any, prompts: list[Any], params: Any) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


# Substrings of the GPU kernels that serve the routed experts: the package's Triton and Gluon
# kernels (the Hopper prefill GEMMs are grouped_w4_gemm_kernel and grouped_w4_gemm_rs_kernel), vLLM's
# Marlin MoE and its unquantized fused MoE (routing, permutation and combine included; the router's
# gate GEMM and top-k are not). torch's own kernels that the package launches (the gather of FC1's
# rows before the warp-specialized GEMM; before 2026-12-04 also the routing of more than 4096
# routes: a sort, scatter_add_, cumsums) have generic names and are not counted.
MOE_KERNELS = (
    "grouped_w4_gemm",
    "fc1_kernel",
    "fc1_finalize_kernel",
    "fc2_kernel",
    "fc1_decode_kernel",
    "fc2_decode_kernel",
    "route_prep_kernel",
    "route_count_kernel",
    "route_offsets_kernel",
    "route_place_kernel",
    "quantize_rows_kernel",
    "permute_k_kernel",
    "combine_kernel",
    "marlin",
    "fused_moe",
    "moe_align",
    "moe_sum",
    "count_and_sort_expert",
)


def is_moe_kernel(name: str) -> bool:
    """Whether the GPU kernel ``name`` serves the routed experts (:data:`MOE_KERNELS`)."""
    lowered = name.lower()
    return any(part in lowered for part in MOE_KERNELS)


def _gpu_profile(llm: Any, prompts: list[Any], params: Any) -> dict[str, Any]:
    """One ``generate`` under ``torch.profiler``: wall seconds, GPU kernel seconds (CUDA-graph
    replays included where CUPTI reports them), the MoE's share of them (:func:`is_moe_kernel`,
    with the kernels counted) and the 12 kernels with the most GPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = _timed(llm, prompts, params)
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] = kernels.get(event.name, 0.0) + event.time_range.elapsed_us() * 1e-6
    top = sorted(kernels.items(), key=lambda item: -item[1])[:12]
    moe = {name: seconds for name, seconds in kernels.items() if is_moe_kernel(name)}
    return {
        "wall_s": wall,
        "gpu_kernel_s": sum(kernels.values()),
        "moe_gpu_s": sum(moe.values()),
        "moe_kernels": sorted(name[:100] for name in moe),
        "top_kernels": [{"kernel": name[:100], "seconds": seconds} for name, seconds in top],
    }


def _moe_kernels(llm: Any) -> list[str]:
    """Class names of what serves the routed experts (quant method and its experts kernel)."""

    def names(model: Any) -> list[str]:
        found = set()
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is None or ("MoE" not in type(method).__name__ and "Moe" not in type(method).__name__):
                continue
            found.add(type(method).__name__)
            for value in vars(method).values():
                kind = type(value).__name__
                if any(word in kind for word in ("Experts", "Marlin", "Kernel", "Backend")):
                    found.add(f"{kind}({getattr(value, 'name', value)})" if "Backend" in kind else kind)
        return sorted(found)

    return llm.apply_model(names)[0]


def run_config(name: str, checkpoint: Path, prefill_length: int) -> dict[str, Any]:
    """Load one configuration in this process and measure it (see the module docstring)."""
    from a4prefill.tools.environment import in_process_engine, scoped_settings

    # pass records live in this process; compile caches off (the pass runs)
    settings = in_process_engine(compile_cache=False)
    settings["environment"] = {**settings["environment"], **CONFIGS[name].get("environment", {})}
    with scoped_settings(**settings):
        return _run_config(name, checkpoint, prefill_length)


def engine_arguments(name: str, checkpoint: Path, prefill_length: int) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments of configuration ``name`` (its quantization, the split
    pass, CUDA-graph mode and a4prefill settings; the engine sizes every configuration shares)."""
    from a4prefill.passes.split_prefill import DEFAULT_PASS, PASS_KEY

    config = CONFIGS[name]
    compilation: dict[str, Any] = {
        "cudagraph_mode": config.get("cudagraph_mode", "FULL_AND_PIECEWISE"),
        "max_cudagraph_capture_size": CAPTURE_LIMIT,
        "compile_ranges_endpoints": [CAPTURE_LIMIT],
    }
    if config["split"]:
        compilation["inductor_passes"] = {PASS_KEY: DEFAULT_PASS}
    arguments: dict[str, Any] = {
        "model": str(checkpoint),
        "quantization": config["quantization"],
        "dtype": "bfloat16",
        "max_model_len": prefill_length + 2 * DECODE_TOKENS,
        "max_num_batched_tokens": prefill_length,
        "max_num_seqs": max(DECODE_BATCHES),
        "gpu_memory_utilization": 0.5,
        "enable_prefix_caching": False,
        "seed": 0,
        "compilation_config": compilation,
    }
    if "settings" in config:
        arguments["additional_config"] = {"a4prefill": config["settings"]}
    return arguments


def _run_config(name: str, checkpoint: Path, prefill_length: int) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from a4prefill.tools import rank_evidence
    from a4prefill.tools.capture import prompt_logprobs
    from a4prefill.vllm_integration import register

    register()
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    started = time.perf_counter()
    llm = LLM(**engine_arguments(name, checkpoint, prefill_length))
    result: dict[str, Any] = {"config": name, "engine_start_s": time.perf_counter() - started}
    result["moe_kernels"] = _moe_kernels(llm)
    result["pass_records"] = llm.collective_rpc(rank_evidence.pass_records)[0]  # rank 0's

    numerics_prompts = _token_prompts(NUMERICS_PROMPTS, NUMERICS_LENGTH, vocab, seed=1)
    result["prompt_logprobs"] = prompt_logprobs(llm, numerics_prompts)

    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefill_prompt = _token_prompts(1, prefill_length, vocab, seed=2)
    _timed(llm, prefill_prompt, one_token)
    prefill_s = statistics.median(_timed(llm, prefill_prompt, one_token) for _ in range(REPEATS))
    result["prefill"] = {
        "tokens": prefill_length,
        "seconds": prefill_s,
        "tokens_per_s": prefill_length / prefill_s,
    }

    longer = SamplingParams(max_tokens=1 + DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    result["decode"] = {}
    for batch in DECODE_BATCHES:
        prompts = _token_prompts(batch, DECODE_PROMPT, vocab, seed=3 + batch)
        _timed(llm, prompts, longer)
        short = min(_timed(llm, prompts, one_token) for _ in range(REPEATS))
        long = min(_timed(llm, prompts, longer) for _ in range(REPEATS))
        result["decode"][str(batch)] = {
            "seconds": long - short,
            "tokens_per_s": batch * DECODE_TOKENS / (long - short),
        }
    import torch

    if torch.cuda.is_available():
        result["profile"] = {
            "prefill": _gpu_profile(llm, prefill_prompt, one_token),
            "decode_batch_1": _gpu_profile(llm, _token_prompts(1, DECODE_PROMPT, vocab, seed=4), longer),
        }
    return result


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per configuration: logprob difference against the reference, prefill and decode tok/s."""
    from a4prefill.tools.numerics.report import logprob_difference

    summary: dict[str, dict[str, Any]] = {}
    for name, result in results.items():
        row: dict[str, Any] = {
            "prefill_tokens_per_s": result["prefill"]["tokens_per_s"],
            "decode_tokens_per_s": {b: d["tokens_per_s"] for b, d in result["decode"].items()},
            "moe_kernels": result["moe_kernels"],
        }
        for phase, profiled in result.get("profile", {}).items():
            row[f"{phase}_gpu_over_wall"] = [profiled["gpu_kernel_s"], profiled["wall_s"]]
            row[f"{phase}_moe_gpu_s"] = profiled.get("moe_gpu_s")
        if REFERENCE in results and name != REFERENCE:
            row["logprob_vs_bf16"] = logprob_difference(
                results[REFERENCE]["prompt_logprobs"], result["prompt_logprobs"]
            )
        summary[name] = row
    return summary


def markdown_table(data: dict[str, Any]) -> str:
    """The results as a markdown table: one row per configuration, failed ones with their exit."""
    summary = data["summary"]
    batches = [str(b) for b in DECODE_BATCHES]
    lines = [
        "| configuration | logprob diff vs bf16: median | p90 | max "
        + f"| prefill {data['prefill_tokens']} tok/s | "
        + " | ".join(f"decode b={b} tok/s" for b in batches)
        + " | profiled GPU / wall ms: prefill | decode b=1 | MoE GPU ms: prefill | decode b=1 | MoE kernel |",
        "|---|---|---|---|---|" + "---|" * len(batches) + "---|---|---|---|---|",
    ]
    for name, row in summary.items():
        diff = row.get("logprob_vs_bf16") or {}
        cells = [f"{diff[k]:.4f}" if k in diff else "-" for k in ("median", "p90", "max")]
        decode = [f"{row['decode_tokens_per_s'][b]:.0f}" for b in batches]
        kernels = ", ".join(row["moe_kernels"])
        profiled = [
            "{:.1f} / {:.1f}".format(*(1e3 * t for t in row[key])) if key in row else "-"
            for key in ("prefill_gpu_over_wall", "decode_batch_1_gpu_over_wall")
        ]
        moe = [
            f"{1e3 * row[key]:.1f}" if row.get(key) is not None else "-"
            for key in ("prefill_moe_gpu_s", "decode_batch_1_moe_gpu_s")
        ]
        lines.append(
            f"| {name} | "
            + " | ".join([*cells, f"{row['prefill_tokens_per_s']:.0f}", *decode, *profiled, *moe, kernels])
            + " |"
        )
    width = 10 + len(batches)
    for name, failure in data.get("failed", {}).items():
        lines.append(f"| {name} | failed: {failure['reason']} |" + " |" * (width - 2))
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = data["summary"]
    names = list(summary)
    if not names:
        raise ValueError(
            f"no configuration completed: nothing to plot ({sorted(data.get('failed', {}))} failed)"
        )
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
    axes[0].bar(names, [summary[n]["prefill_tokens_per_s"] for n in names], color="tab:blue")
    axes[0].set_title(f"prefill, one {data['prefill_tokens']}-token prompt")
    axes[0].set_ylabel("tokens/s")
    width = 0.8 / len(names)
    for index, name in enumerate(names):
        xs = [b + index * width for b in range(len(DECODE_BATCHES))]
        axes[1].bar(
            xs, [summary[name]["decode_tokens_per_s"][str(b)] for b in DECODE_BATCHES], width, label=name
        )
    axes[1].set_xticks(
        [b + 0.4 - width / 2 for b in range(len(DECODE_BATCHES))], [str(b) for b in DECODE_BATCHES]
    )
    axes[1].set_xlabel("batch")
    axes[1].set_ylabel("decode tokens/s")
    axes[1].set_title("decode (captured FULL graphs)")
    axes[1].legend(fontsize=8)
    compared = [n for n in names if "logprob_vs_bf16" in summary[n]]
    for offset, key in enumerate(("median", "p90")):
        axes[2].bar(
            [i + offset * 0.4 for i in range(len(compared))],
            [summary[n]["logprob_vs_bf16"][key] for n in compared],
            0.4,
            label=key,
        )
    axes[2].set_xticks([i + 0.2 for i in range(len(compared))], compared)
    axes[2].set_title("|prompt logprob - bf16 MoE| per token")
    axes[2].legend()
    profiled = [n for n in names if summary[n].get("prefill_moe_gpu_s") is not None]
    for offset, (key, label) in enumerate(
        (("prefill_moe_gpu_s", "prefill (8K prompt)"), ("decode_batch_1_moe_gpu_s", "decode, batch 1"))
    ):
        axes[3].bar(
            [i + offset * 0.4 for i in range(len(profiled))],
            [1e3 * summary[n][key] for n in profiled],
            0.4,
            label=label,
        )
    axes[3].set_xticks([i + 0.2 for i in range(len(profiled))], profiled)
    axes[3].set_ylabel("ms of GPU kernel time")
    axes[3].set_title("the MoE's GPU time (profiled generate)")
    axes[3].legend(fontsize=8)
    for axis in axes:
        axis.tick_params(axis="x", labelrotation=15, labelsize=8)
    model = data["model"]
    fig.suptitle(
        f"random NVFP4 MoE model: hidden {model['hidden_size']}, intermediate "
        f"{model['moe_intermediate_size']}, {model['num_experts']} experts, top-{model['top_k']}, "
        f"{model['num_layers']} layers; {data['device']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--model", choices=sorted(MODELS), default="large")
    parser.add_argument(  # the oracle's slow run only when asked for
        "--configs", default=",".join(name for name in CONFIGS if name != "a4prefill_split_a8_reference")
    )
    parser.add_argument("--work", default="/tmp/a4prefill-bench-vllm-paths")
    parser.add_argument(
        "--prefill-length", type=int, default=8192, help="prompt tokens of the prefill timing"
    )
    parser.add_argument("--plot", help="only plot this JSON result next to it")
    parser.add_argument("--table", help="only print this JSON result as a markdown table")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        return
    if args.table:
        print(markdown_table(json.loads(Path(args.table).read_text())))
        return
    names = [name for name in args.configs.split(",") if name]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown or not names:
        parser.error(f"--configs: expected a comma list of {sorted(CONFIGS)}, got {args.configs!r}")
    if args.prefill_length < 1:
        parser.error(f"--prefill-length: expected a positive integer, got {args.prefill_length}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    checkpoints, rebuilt = build_checkpoints(args.model, work)
    if args.one:
        checkpoint = checkpoints[CONFIGS[args.one]["checkpoint"]]
        result = run_config(args.one, checkpoint, args.prefill_length)
        result_path(work, args.model, args.one, args.prefill_length).write_text(json.dumps(result))
        return
    if rebuilt:  # results measured on the checkpoints before are stale
        for stale in work.glob(f"{args.model}-p*-*.json"):
            stale.unlink()
    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, dict[str, Any]] = {}
    for name in names:
        path = result_path(work, args.model, name, args.prefill_length)
        if not path.exists():
            log = result_path(work, args.model, name, args.prefill_length, ".log")
            with log.open("w") as handle:
                command = [
                    sys.executable,
                    __file__,
                    "--one",
                    name,
                    "--model",
                    args.model,
                    "--work",
                    str(work),
                ]
                command += ["--prefill-length", str(args.prefill_length)]
                code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT).returncode
            if code != 0:
                tail = log.read_text().splitlines()[-30:]
                print(f"{name}: exit {code}; last lines of {log}:", file=sys.stderr)
                print("\n".join(tail), file=sys.stderr)
                errors = [line for line in tail if "Error" in line or "error" in line]
                failed[name] = {
                    "reason": f"exit {code}: {(errors or tail or [''])[-1][:160]}",
                    "log_tail": tail,
                }
                continue
        results[name] = json.loads(path.read_text())
        print(f"{name}: done", flush=True)
    import torch

    from a4prefill.tools.tiny_model import TinyModelSpec

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    data = {
        "model": asdict(TinyModelSpec(**MODELS[args.model])),
        "device": device,
        "prefill_tokens": args.prefill_length,
        "results": results,
        "summary": summarize(results),
        "failed": failed,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT_FILE).write_text(json.dumps(data, indent=1))
    print(markdown_table(data))
    if not results:
        print("no plot: every configuration failed (the table lists why)")
        return
    try:
        plot(data, out / RESULT_FILE.replace(".json", ".png"))
    except ImportError as error:
        print(f"no plot ({error}); run --plot {out / RESULT_FILE} where matplotlib is installed")


if __name__ == "__main__":
    main()
