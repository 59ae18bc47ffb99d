"""`fitserve plan TOOL ...`: planner sheets for questions met outside one engine.

Each tool is a module here with ``add_arguments(parser)`` and ``build(args) -> Sheet``; the
shared runner (``sheet.run_tool``) adds ``--json`` and ``--explain``, renders the sheet as rich
tables, and turns a PlanError into exit status 2 with the reason. ``fitserve plan MODEL`` (the
deployment plan) is unchanged: a first argument naming a tool routes here instead.
"""

from __future__ import annotations

# name -> (module under fitserve.tools.sheets, one-line help). Kept as data so that
# `fitserve plan --help` can list the tools without importing them.
TOOLS: dict[str, tuple[str, str]] = {
    "longctx": ("longctx", "1M-token contexts: KV per request, attention share, a context-parallel layout"),
    "layouts": ("cluster_layouts", "TP vs PP vs hybrid across nodes: all-reduces, bubble, slow links"),
    "fleet": ("fleet", "loading model bytes onto many replicas: storage, NIC and disk bounds"),
    "canary": ("canary", "requests per arm to detect a regression, and the staged rollout"),
    "capacity": ("capacity", "capacity units at an SLO across GPU generations, routing, purchases"),
    "voice": ("voice", "the 300 ms first-audio budget line by line and the LLM tier it needs"),
    "offload": ("offload", "moving weights, embeddings or KV to host memory: bytes, bandwidth, latency"),
    "explain": ("explain", "explain sheets computed from the catalog (plan explain --list)"),
}
