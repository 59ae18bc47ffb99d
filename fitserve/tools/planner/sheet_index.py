"""The sheets of `fitserve plan TOOL ...` (fitserve.tools.sheets), as data: `fitserve plan --help`
lists them and the CLI routes to them without importing them, and the planner stays below the
sheets that build on it."""

from __future__ import annotations

# name -> (module under fitserve.tools.sheets, one-line help)
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
