"""Runtime kernels only: cpu/ (C++ compiled at first use, cached, with a pure-torch fallback),
triton/ (CUDA, imported on demand) and the split-count rule the Triton decode sizes its grid with.
The float64 references and study kernels the engine never runs live in fitserve.tools.labs."""
