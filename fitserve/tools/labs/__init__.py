"""Reference kernels and studies the engine never runs: float64 attention, tiled/online-softmax
forward and backward, split-KV decode, paged and varlen variants, sliding-window tile counting,
GQA packing, RoPE, RMSNorm, byte/FLOP counters (``fitserve kernels``), fp8 attention."""
