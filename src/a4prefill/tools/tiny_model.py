"""A tiny random MoE checkpoint with ModelOpt NVFP4 experts (tests, demos; no hub access).

Two architectures (``TinyModelSpec.architecture``): ``qwen3_moe`` (the default, the built-in
tiny model: experts ``mlp.experts.E.{gate,up,down}_proj``) and ``mixtral`` (experts
``block_sparse_moe.experts.E.{w1,w3,w2}``, no q/k norms), both served by vLLM as they are.

``make_tiny_model(directory)`` writes:

- ``config.json`` (``Qwen3MoeForCausalLM`` / ``MixtralForCausalLM``, ``quantization_config`` as
  ModelOpt writes it),
  ``hf_quant_config.json`` (ModelOpt's legacy file), ``generation_config.json``;
- ``tokenizer.json`` + ``tokenizer_config.json``: a word-level tokenizer built offline with the
  ``tokenizers`` library (lower-case words, digits and punctuation; unknown words map to
  ``<unk>``);
- ``model.safetensors``: bf16 embeddings, attention, norms, router and ``lm_head`` (listed in
  ``ignore``/``exclude_modules``), NVFP4 experts quantized by
  :func:`a4prefill.ops.quantize_moe_weights` (``weight``, ``weight_scale``, ``weight_scale_2``,
  ``input_scale`` per projection). Input scales are calibrated on the model's own activations
  (random tokens through the float model); the MoE layer ``uncalibrated_layer`` (default: the
  last; ``None``: every layer calibrated) has no ``input_scale`` tensors at all, like an MTP draft
  layer;
- ``a4prefill_tiny_model.json``: the package version, a hash of this recipe and the spec.
  :func:`a4prefill.tools.e2e.ensure_tiny_model` rebuilds a model whose stamp differs.

Who may call: the CLI (``python -m a4prefill make-tiny-model DIR``), the vLLM end-to-end run,
tests. Needs ``safetensors``, ``tokenizers`` (both come with vLLM / transformers).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import string
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from a4prefill.ops.modelopt import NvFp4MoEWeights, quantize_moe_weights
from a4prefill.tools.tiny_layer import routed_input_amax

_WORD_TEXT = (
    "the a an and or of to in on at for with from by is are was were be been it this that these "
    "those i you he she we they me him her us them my your his its our their what which who "
    "when where why how all any both each few more most other some such no not only own same so "
    "than too very can will just should now one two three four five six seven eight nine ten "
    "hundred cat dog bird fish tree house car road city river sea sky sun moon star water fire "
    "earth air red green blue black white big small long short old new good bad hot cold fast "
    "slow happy run walk eat drink see say go come make take give know think look want use find "
    "tell ask work call try feel leave put mean keep let begin seem help show hear play move "
    "live believe time year day week month morning night people man woman child world life hand "
    "part place number question answer story word name music book school model token prefill "
    "decode once upon there lived little who loved count list alphabet colors animals weather "
    "today"
)
WORDS = tuple(_WORD_TEXT.split(" "))
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
STAMP_FILE = "a4prefill_tiny_model.json"


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of the tiny model (hidden and moe_intermediate multiples of 16)."""

    num_layers: int = 3
    hidden_size: int = 128
    moe_intermediate_size: int = 64
    num_experts: int = 8
    top_k: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    uncalibrated_layer: int | None = -1  # None: every MoE layer has input scales
    seed: int = 0
    calibration_tokens: int = 256
    architecture: str = "qwen3_moe"  # or "mixtral"

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture must be one of {sorted(ARCHITECTURES)}, got {self.architecture!r}"
            )

    @property
    def uncalibrated_index(self) -> int | None:
        """The MoE layer without input scales, or ``None`` when every layer has them."""
        return None if self.uncalibrated_layer is None else self.uncalibrated_layer % self.num_layers


@dataclass(frozen=True)
class Architecture:
    """Checkpoint names of one architecture: the MoE block, its router, the expert projections
    (gate, up, down), whether attention has q/k norms, the HF class and model type."""

    hf_class: str
    model_type: str
    moe_block: str
    projections: tuple[str, str, str]
    qk_norm: bool


ARCHITECTURES = {
    "qwen3_moe": Architecture(
        "Qwen3MoeForCausalLM", "qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj"), True
    ),
    "mixtral": Architecture("MixtralForCausalLM", "mixtral", "block_sparse_moe", ("w1", "w3", "w2"), False),
}


# The sizes of a real MoE layer at small scale (Qwen3-30B-A3B-like experts: hidden 2048, expert
# intermediate 768, 64 experts, top-8): shapes that the triton backend's decode kernels take (H a
# multiple of 512, I of 256) at decode sizes and its prefill kernels (sm_90; the tiled kernels
# elsewhere) at prefill sizes, unlike the tiny default. Used by the e2e harness (``--shape
# real``) and the served benchmark.
REAL_SHAPE: dict[str, Any] = {
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "num_experts": 64,
    "top_k": 8,
    "num_heads": 16,
    "num_kv_heads": 4,
    "head_dim": 128,
}
MODEL_SHAPES = {"tiny": TinyModelSpec(), "real": TinyModelSpec(**REAL_SHAPE)}


def recipe_stamp(spec: TinyModelSpec) -> dict[str, Any]:
    """What a built tiny model must match to be reused: package version, recipe hash, spec."""
    from a4prefill import __version__

    recipe = hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()
    return {"package_version": __version__, "recipe": recipe, "spec": asdict(spec)}


def build_tokenizer(vocab_size: int) -> tuple[dict, dict]:
    """``(tokenizer.json, tokenizer_config.json)`` contents of the word-level tokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    symbols = list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *WORDS, *symbols):
        vocab.setdefault(token, len(vocab))
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(vocab)} tokens")
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<unk>",
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
    }
    return json.loads(tokenizer.to_str()), config


def _config_json(spec: TinyModelSpec, ignore: list[str]) -> dict:
    arch = ARCHITECTURES[spec.architecture]
    # Mixtral's experts use ``intermediate_size``; Qwen3-MoE's ``moe_intermediate_size``.
    dense = spec.moe_intermediate_size if spec.architecture == "mixtral" else 4 * spec.hidden_size
    return {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": dense,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "num_local_experts": spec.num_experts,
        "sliding_window": None,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            "ignore": ignore,
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False},
                    "input_activations": {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False},
                }
            },
            "producer": {"name": "a4prefill", "version": "0.1.0"},
        },
    }


def _rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def ensure_tiny_model_built(directory: Path, spec: TinyModelSpec) -> bool:
    """(Re)build the tiny checkpoint of ``spec`` in ``directory`` unless it holds this package
    version's recipe of that spec (:func:`recipe_stamp`); True when it was (re)built. Only for
    the package's own models: never called on a user's checkpoint."""
    stamp = directory / STAMP_FILE
    if (
        (directory / "model.safetensors").exists()
        and stamp.exists()
        and json.loads(stamp.read_text()) == recipe_stamp(spec)
    ):
        return False
    make_tiny_model(directory, spec)
    return True


def make_tiny_model(directory: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write the tiny checkpoint into ``directory`` (created; existing files overwritten)."""
    from safetensors.torch import save_file

    spec = spec or TinyModelSpec()
    arch = ARCHITECTURES[spec.architecture]
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(spec.seed)
    hidden, inter, experts = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    tensors: dict[str, torch.Tensor] = {}
    bf16 = torch.bfloat16
    embed = rand(spec.vocab_size, hidden, scale=1.0)
    tensors["model.embed_tokens.weight"] = embed.to(bf16)
    tensors["model.norm.weight"] = torch.ones(hidden, dtype=bf16)
    tensors["lm_head.weight"] = rand(spec.vocab_size, hidden, scale=hidden**-0.5).to(bf16)
    q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    calibration = embed[torch.randint(0, spec.vocab_size, (spec.calibration_tokens,), generator=generator)]
    for index in range(spec.num_layers):
        prefix = f"model.layers.{index}"
        for name, out_features, in_features in (
            ("q_proj", q_out, hidden),
            ("k_proj", kv_out, hidden),
            ("v_proj", kv_out, hidden),
            ("o_proj", hidden, q_out),
        ):
            tensors[f"{prefix}.self_attn.{name}.weight"] = rand(
                out_features, in_features, scale=in_features**-0.5
            ).to(bf16)
        if arch.qk_norm:
            tensors[f"{prefix}.self_attn.q_norm.weight"] = torch.ones(spec.head_dim, dtype=bf16)
            tensors[f"{prefix}.self_attn.k_norm.weight"] = torch.ones(spec.head_dim, dtype=bf16)
        tensors[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden, dtype=bf16)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=bf16)
        router = rand(experts, hidden, scale=hidden**-0.5)
        tensors[f"{prefix}.{arch.moe_block}.gate.weight"] = router.to(bf16)
        w13 = rand(experts, 2 * inter, hidden, scale=hidden**-0.5)
        w2 = rand(experts, hidden, inter, scale=inter**-0.5)
        calibrated = index != spec.uncalibrated_index
        normed = _rms_norm(calibration)
        fc1_amax, fc2_amax = routed_input_amax(
            normed, (normed @ router.T).topk(spec.top_k, dim=1).indices, w13
        )
        quantized = quantize_moe_weights(
            w13, w2, fc1_amax if calibrated else None, fc2_amax if calibrated else None
        )
        experts_prefix = f"{prefix}.{arch.moe_block}.experts"
        tensors.update(expert_tensors(experts_prefix, quantized, arch, with_input_scales=calibrated))
        # a residual stream update so later layers see different activations
        calibration = calibration + 0.1 * rand(*calibration.shape, scale=1.0)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    ignore = ["lm_head", "model.layers.*.self_attn*", f"model.layers.*.{arch.moe_block}.gate"]
    (path / "config.json").write_text(json.dumps(_config_json(spec, ignore), indent=2))
    legacy = {
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": ignore,
        },
    }
    (path / "hf_quant_config.json").write_text(json.dumps(legacy, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    tokenizer, tokenizer_config = build_tokenizer(spec.vocab_size)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (path / STAMP_FILE).write_text(json.dumps(recipe_stamp(spec), indent=2))
    return path


def expert_tensors(
    prefix: str, weights: NvFp4MoEWeights, arch: Architecture, with_input_scales: bool
) -> dict[str, torch.Tensor]:
    """Per-expert ModelOpt tensors (gate, up, down projections) of one layer."""
    out: dict[str, torch.Tensor] = {}
    gate_name, up_name, down_name = arch.projections
    inter = weights.w13_weight.shape[1] // 2
    for expert in range(weights.w13_weight.shape[0]):
        halves = {gate_name: slice(0, inter), up_name: slice(inter, 2 * inter)}
        for column, (name, rows) in enumerate(halves.items()):
            base = f"{prefix}.{expert}.{name}"
            out[f"{base}.weight"] = weights.w13_weight[expert, rows]
            out[f"{base}.weight_scale"] = weights.w13_weight_scale[expert, rows]
            out[f"{base}.weight_scale_2"] = weights.w13_weight_scale_2[expert, column].reshape(())
            if with_input_scales:
                out[f"{base}.input_scale"] = weights.w13_input_scale[expert, column].reshape(())
        base = f"{prefix}.{expert}.{down_name}"
        out[f"{base}.weight"] = weights.w2_weight[expert]
        out[f"{base}.weight_scale"] = weights.w2_weight_scale[expert]
        out[f"{base}.weight_scale_2"] = weights.w2_weight_scale_2[expert].reshape(())
        if with_input_scales:
            out[f"{base}.input_scale"] = weights.w2_input_scale[expert].reshape(())
    return out
