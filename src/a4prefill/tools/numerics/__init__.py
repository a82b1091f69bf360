"""``python -m a4prefill numerics CHECKPOINT``: what A4 costs in accuracy, layer by layer.

- :mod:`.checkpoint`: a ModelOpt NVFP4 MoE checkpoint read lazily, one layer at a time;
- :mod:`.layer_metrics`: one layer's numbers on captured inputs (A4 vs W4A16, W4A16 vs a bf16
  MoE on the dequantized weights, cosine similarity, saturating activation blocks);
- :mod:`.report`: the per-layer report, the suggested ``excluded_layers`` and its files (table,
  JSON, CSV, PNG);
- the inputs (router inputs and routing of every MoE layer, prompt logprobs) come from vLLM:
  :mod:`a4prefill.tools.capture`.
"""
