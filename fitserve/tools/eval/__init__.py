"""Quantization evaluation beyond perplexity (KL, flips, intervals), per-layer sensitivity sweeps
and ``fitserve eval``; data/ holds the shipped held-out texts."""
