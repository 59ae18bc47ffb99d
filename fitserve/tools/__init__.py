"""Offline commands and studies. Nothing on the serving path imports this package (the CLI entry
point may): planner/ (the ``fitserve plan`` report), sheets/ (``fitserve plan <sheet>``),
quantize/, eval/, profile/, bench/, labs/ (reference kernels and studies the engine never runs)."""
