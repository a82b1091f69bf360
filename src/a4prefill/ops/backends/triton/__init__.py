"""The ``triton`` backend: grouped NVFP4 MoE GEMMs in Triton and Gluon on any CUDA GPU, one job a
module. Registered as ``"triton"`` by :mod:`a4prefill.ops.backends`.

Host side (imports without Triton; launches without a host sync):

- :mod:`backend`: ``TritonBackend``, the backend interface (row plans, kernel family, warm-up);
- :mod:`fused`: ``fused_moe``, one MoE call (routing, A4 quantization, the tiled or the decode
  GEMMs, the top-k combine) and ``row_flags_for``;
- :mod:`plan`: ``CallPlan`` (``plan_call``), what a call launches, from its shapes, io dtype and
  device;
- :mod:`schedules`: the tiles of the tiled kernels (``GemmConfig``, ``choose_config``) and the
  decode kernels' schedules (``DecodeGemm``, ``DecodeTiles``) by call size, as named rules
  (``DecodeScheduleRule``, ``DECODE_SCHEDULES``, ``choose_decode_tiles``);
- :mod:`routing`: routes sorted by expert on the GPU (``Routing``, ``RoutingLaunch``,
  ``build_routing``) and the routing layout every GEMM kernel reads;
- :mod:`quantize`: A4 rows quantized on the GPU (``quantize_rows``);
- :mod:`warmup`: the load-time warm-up, one call per plan and precision;
- :mod:`prefill`: ``launch_prefill_gemm``, the host side of the prefill GEMM;
- :mod:`kernel_modules`: the host side's lazy imports of the kernel modules below.

Kernel side (imported lazily, at the first launch or when the backend is asked about a CUDA
device; needs Triton, the decode modules Triton 3.6+ with Gluon):

- :mod:`numerics`: Triton JIT helpers: the kernels' ``MODE`` constexprs, e4m3/e2m1 rounding,
  per-16 quantization, weight dequantization (Triton ops or inline PTX), SwiGLU;
- :mod:`shared_kernels`: the kernels both GEMM paths launch (routing, A4 row quantization, the
  top-k combine);
- :mod:`tiled_kernels`: the tiled FC1 and FC2 GEMMs;
- :mod:`decode_kernels`: the Gluon FC1 and FC2 GEMMs for few routes per expert, and the
  activation permutation they read;
- :mod:`decode_layouts`: their layouts and K relabelling; :mod:`decode_asm`: their inline PTX;
- :mod:`prefill_kernels`, :mod:`prefill_ws_kernels`, :mod:`prefill_a8_kernels`: the Hopper
  prefill GEMMs (Gluon, sm_90a, wgmma; issues 23 and 28), launched by :mod:`prefill` where
  :mod:`plan` chooses them (bf16 calls from ``schedules.PREFILL_MIN_ROWS_PER_EXPERT`` routes per
  expert) and for every A8 call (:mod:`fused_a8`).

The package shares its name with the Triton library, which does not shadow it: every module of
the project imports absolutely (``import triton`` is the library everywhere, this package is only
ever ``a4prefill.ops.backends.triton``) and nothing puts this folder on ``sys.path``.
"""
