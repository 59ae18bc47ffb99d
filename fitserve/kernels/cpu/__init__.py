"""C++ CPU kernels compiled at first use (torch.utils.cpp_extension), with pure-torch fallbacks.

``build.load_extension`` compiles a source file once per (source hash, ISA flags, torch version)
into ``$FITSERVE_HOME/extensions`` and returns None when no compiler is present, the build
fails, or ``FITSERVE_DISABLE_CPP=1``: callers then take their pure-torch path.
"""
