"""The import graph of fitserve: no cycles, and torch stays out of the torch-free parts.

Every .py under fitserve/ is parsed with ``ast``; imports of fitserve modules are collected,
at module level and inside functions (``if TYPE_CHECKING:`` blocks are left out: they never
run). Checked:

(a) no import cycle among MODULE-LEVEL imports (what runs when a module is imported; imports
    inside functions run later and may go "up" on purpose, e.g. PEP 562 lazy names);
(b) fitserve.kv, fitserve.sched, fitserve.plan and the model readers import neither torch nor
    anything that imports it: their own imports at any level, and transitively every
    module-level import of what they reach, including the package ``__init__`` modules that
    importing a submodule runs; then the same at run time, in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "fitserve"
TORCH_FREE_ROOTS = ("fitserve.kv", "fitserve.sched", "fitserve.plan")
READERS = ("fitserve.loading.hf_config", "fitserve.loading.gguf_spec",
           "fitserve.loading.hf_defaults", "fitserve.loading.weight_names",
           "fitserve.loading.errors")
TORCH_LIKE = ("torch", "triton", "transformers", "safetensors.torch")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in PKG.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _resolve(base: str, names: list[str]) -> list[str]:
    """Targets of ``from base import names``: base.name where that is a module, else base."""
    out = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
    if len(out) < len(names):
        out.append(base)
    return out


def imports(module: str) -> tuple[set[str], set[str]]:
    """(module-level, all) imported names: fitserve modules and external top-level ones."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top: set[str] = set()
    every: set[str] = set()

    def visit(node: ast.AST, at_top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit_stmt(sub, at_top)
                continue
            visit_stmt(child, at_top)

    def visit_stmt(child: ast.AST, at_top: bool) -> None:
        found: list[str] = []
        if isinstance(child, ast.Import):
            found = [a.name for a in child.names]
        elif isinstance(child, ast.ImportFrom):
            if child.level:
                base = package.rsplit(".", child.level - 1)[0] if child.level > 1 else package
                base = f"{base}.{child.module}" if child.module else base
            else:
                base = child.module or ""
            found = (_resolve(base, [a.name for a in child.names])
                     if base.startswith("fitserve") else [base])
        every.update(found)
        if at_top:
            top.update(found)
        inner = at_top and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef |
                                          ast.Lambda)
        visit(child, inner)

    visit(tree, True)
    return top, every


GRAPH = {m: imports(m) for m in MODULES}


def parents(module: str) -> list[str]:
    """The packages whose __init__ runs before ``module`` (fitserve, fitserve.x, ...)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in MODULES]


def test_graph_sees_known_edges() -> None:
    """The walker itself: known imports of each kind are found (else the checks prove nothing)."""
    top, every = GRAPH["fitserve.engine"]
    assert "fitserve.engine_setup" in top and "torch" in top
    _, every = GRAPH["fitserve.cli"]
    assert "fitserve.engine" in every and "fitserve.engine" not in GRAPH["fitserve.cli"][0]
    assert "fitserve.loading.hf_defaults" in GRAPH["fitserve.loading.hf_config"][0]  # from pkg
    assert "fitserve.loading.gguf" in GRAPH["fitserve.loading"][1]  # lazy, inside a function
    assert "fitserve.loading.gguf" not in GRAPH["fitserve.loading"][0]


def test_no_module_level_import_cycle() -> None:
    edges = {m: {t for t in GRAPH[m][0] if t in MODULES and t != m} for m in MODULES}
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []
    cycles: list[list[str]] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                dfs(t)
        stack.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            dfs(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def torch_free_set() -> list[str]:
    roots = [m for m in MODULES if m.startswith(TORCH_FREE_ROOTS)]
    return sorted({*roots, *READERS})


def test_torch_free_parts_never_reach_torch() -> None:
    bad: list[str] = []
    for start in torch_free_set():
        # its own imports at any level, then module-level imports of all it reaches
        seen: dict[str, str] = {}
        todo = [(t, start) for t in GRAPH[start][1] | set(parents(start))]
        while todo:
            mod, via = todo.pop()
            if mod in seen:
                continue
            seen[mod] = via
            if mod.startswith(TORCH_LIKE) or mod.split(".")[0] in ("torch", "triton"):
                chain = [mod]
                while chain[-1] != start:
                    chain.append(seen.get(chain[-1], start))
                bad.append(" <- ".join(chain))
                continue
            if mod in MODULES:
                todo += [(t, mod) for t in GRAPH[mod][0] | set(parents(mod))]
    assert not bad, "torch reached from torch-free modules:\n" + "\n".join(sorted(set(bad)))


def test_torch_free_at_run_time(tmp_path: Path) -> None:
    from tests.tiny_gguf import TinyGGUF, write_tiny_gguf

    gguf_file = write_tiny_gguf(tmp_path / "m.gguf", TinyGGUF(arch="qwen2", qkv_bias=True))
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 64, '
                                          '"intermediate_size": 96, "num_hidden_layers": 2, '
                                          '"num_attention_heads": 4, "vocab_size": 320}')
    code = (
        "import sys\n"
        "import fitserve.plan.cli_plan, fitserve.kv, fitserve.sched\n"
        f"import {', '.join(READERS)}\n"
        "from fitserve.plan.model_source import resolve_model\n"
        "from fitserve.plan.sections_run import build_plan\n"
        "from fitserve.plan.report import PlanRequest\n"
        "resolve_model('SmolLM2-135M')\n"
        f"assert resolve_model({str(gguf_file)!r}).spec.attention_bias\n"
        f"assert resolve_model({str(tmp_path)!r}).spec.qk_norm\n"
        "build_plan(PlanRequest('Llama-3.1-8B', gpu='h100'))\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', "
        "'transformers'))\n"
        "print(bad)\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
