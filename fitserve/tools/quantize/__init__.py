"""Offline quantizers: RTN/AWQ/GPTQ calibration, SmoothQuant migration and ``fitserve quantize``."""
