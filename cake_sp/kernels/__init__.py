"""Device code: Triton (and Gluon) kernels, one concern per module.

* ``producer`` -- the fused QKV projection + QK RMSNorm + RoPE, its launcher and the
  ``tl.dot`` mainloops (pointer loads, TMA); ``producer_ws`` -- the same kernel with a
  warp-specialised Gluon mainloop (sm_90a, opt-in); ``producer_epilogue`` -- the tile
  order and the epilogue both share (norm, RoPE, stores at every destination, readiness).
* ``signals`` -- the NVLink path's entry barrier, readiness words and bounded waits.
* ``norm_rope`` -- RMSNorm / RoPE / rounding helpers shared by the producer and the
  append kernels.
* ``paged_append`` -- what the two append kernels share (request and tile programs,
  metadata checks); ``qk_rope_append`` (BF16 caches), ``qk_rope_fp8_append`` (FP8).
* ``fmha`` -- paged attention with FlashInfer's TensorRT-LLM convention (its own
  package: API, routes, selector, manifest).
* ``_config`` -- launch heuristics and compile-time switches, with the measurements
  behind them.
"""
