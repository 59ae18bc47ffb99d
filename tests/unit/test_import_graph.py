"""The import graph of fitserve: the layering the tree promises, checked on the source.

Every .py under fitserve/ is parsed with ``ast``; imports of fitserve modules are collected at
three levels: module level (what runs when the module is imported), inside functions (lazy
imports, which run later), and in ``if TYPE_CHECKING:`` blocks (which never run, but still say
"this module needs that one"). Checked:

(a) no import cycle among the modules, with every level's imports counted: a cycle hidden
    behind a function-level or TYPE_CHECKING import is still two modules that need each other;
(b) nothing on the serving path imports fitserve.tools (the offline commands and studies):
    only fitserve.tools itself and the CLI entry point (fitserve.cli.main) may;
(c) the packages form layers (LAYERS, lowest first): a module imports only from its own layer
    or below, at any level, so no two packages need each other; the one exception is the CLI
    entry point wiring the offline tools' subcommands;
(d) fitserve.kv, fitserve.sched, fitserve.ledger, the planner and its sheets, and the model
    readers import neither torch nor anything that imports it: their own imports at any level,
    and transitively every module-level import of what they reach, including the package
    ``__init__`` modules that importing a submodule runs; then the same at run time, in a fresh
    interpreter.

The checks are functions of a source tree, so the last tests plant a cycle, a serving-path
import of tools/, an upward import and a torch import in a copy of the package and show that
each check reports it.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "fitserve"
TORCH_FREE_ROOTS = ("fitserve.kv", "fitserve.sched", "fitserve.ledger", "fitserve.tools.planner",
                    "fitserve.tools.sheets")
READERS = ("fitserve.loading.hf_config", "fitserve.loading.gguf_spec",
           "fitserve.loading.hf_defaults", "fitserve.loading.weight_names",
           "fitserve.loading.errors", "fitserve.loading.support",
           "fitserve.loading.hf_quant_config")
TORCH_LIKE = ("torch", "triton", "transformers", "safetensors.torch")
TOOLS = "fitserve.tools"
MAY_IMPORT_TOOLS = ("fitserve.cli.main",)  # the entry point wires the offline subcommands
# The layers, lowest first: data flows request -> sched (kv) -> runner (model, sampling) ->
# engine -> server, and everything sizes itself with the ledger below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("fitserve.config", "fitserve.types", "fitserve.envs"),
    ("fitserve.ledger",),
    ("fitserve.kv",),
    ("fitserve.sched",),
    ("fitserve.kernels",),
    ("fitserve.quant",),
    ("fitserve.loading",),
    ("fitserve.model",),
    ("fitserve.structured",),
    ("fitserve.sampling",),
    ("fitserve.runner",),
    ("fitserve.spec_decode",),
    ("fitserve.dist",),
    ("fitserve.engine",),
    ("fitserve.server",),
    ("fitserve.fleet",),
    ("fitserve.cli",),
    ("fitserve.tools.planner",),
    ("fitserve.tools",),
)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


@dataclass(slots=True)
class Imports:
    """One module's imports (fitserve modules and external top-level names) by level."""

    top: set[str]  # module level: run on import
    lazy: set[str]  # inside functions: run when called
    typing: set[str]  # under ``if TYPE_CHECKING:``: never run

    @property
    def every(self) -> set[str]:
        return self.top | self.lazy | self.typing

    @property
    def run(self) -> set[str]:
        return self.top | self.lazy


class Graph:
    """The import graph of the package under ``root`` (a folder holding ``fitserve/``)."""

    def __init__(self, root: Path) -> None:
        self.modules = {module_name(p, root): p for p in (root / "fitserve").rglob("*.py")}
        self.imports = {m: self._scan(m) for m in self.modules}

    def _resolve(self, base: str, names: list[str]) -> list[str]:
        """Targets of ``from base import names``: base.name where that is a module, else base."""
        out = [f"{base}.{n}" for n in names if f"{base}.{n}" in self.modules]
        if len(out) < len(names):
            out.append(base)
        return out

    def _scan(self, module: str) -> Imports:
        path = self.modules[module]
        tree = ast.parse(path.read_text(), str(path))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = Imports(set(), set(), set())

        def visit(node: ast.AST, level: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child):
                    for sub in child.body:
                        visit_stmt(sub, "typing")
                    for sub in child.orelse:
                        visit_stmt(sub, level)
                    continue
                visit_stmt(child, level)

        def visit_stmt(child: ast.AST, level: str) -> None:
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.rsplit(".", child.level - 1)[0] if child.level > 1 else package
                    base = f"{base}.{child.module}" if child.module else base
                else:
                    base = child.module or ""
                names = (self._resolve(base, [a.name for a in child.names])
                         if base.startswith("fitserve") else [base])
            getattr(found, level).update(names)
            inner = level
            if level == "top" and isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef |
                                             ast.Lambda):
                inner = "lazy"
            visit(child, inner)

        visit(tree, "top")
        return found

    def parents(self, module: str) -> list[str]:
        """The packages whose __init__ runs before ``module`` (fitserve, fitserve.x, ...)."""
        parts = module.split(".")
        return [p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                if p in self.modules]

    def cycles(self) -> list[list[str]]:
        """Every cycle the depth-first walk meets, over imports of every level."""
        edges = {m: {t for t in self.imports[m].every if t in self.modules and t != m}
                 for m in self.modules}
        state: dict[str, int] = {}  # 1: on the stack, 2: done
        stack: list[str] = []
        found: list[list[str]] = []

        def dfs(m: str) -> None:
            state[m] = 1
            stack.append(m)
            for t in sorted(edges[m]):
                if state.get(t) == 1:
                    found.append(stack[stack.index(t):] + [t])
                elif t not in state:
                    dfs(t)
            stack.pop()
            state[m] = 2

        for m in sorted(self.modules):
            if m not in state:
                dfs(m)
        return found

    def serving_imports_of_tools(self) -> list[str]:
        """``module -> tools module`` for every import of fitserve.tools from outside it."""
        bad = []
        for m, imp in sorted(self.imports.items()):
            if m == TOOLS or m.startswith(TOOLS + ".") or m in MAY_IMPORT_TOOLS:
                continue
            bad += [f"{m} -> {t}" for t in sorted(imp.every)
                    if t == TOOLS or t.startswith(TOOLS + ".")]
        return bad

    def upward_imports(self) -> list[str]:
        """``module -> target`` for every import (any level) of a higher layer than the
        module's own, but the CLI entry point's imports of the tools."""
        bad = []
        for m, imp in sorted(self.imports.items()):
            here = layer_of(m)
            if here is None:
                continue
            for t in sorted(imp.every):
                there = layer_of(t) if t in self.modules else None
                if there is not None and there > here and not (
                        m in MAY_IMPORT_TOOLS and t.startswith(TOOLS + ".")):
                    bad.append(f"{m} -> {t}")
        return bad

    def torch_reached_from(self, starts: list[str]) -> list[str]:
        """Chains ``torch-like <- ... <- start`` for each torch-free start that reaches torch."""
        bad: list[str] = []
        for start in starts:
            # its own imports at any level that runs, then module-level imports of all it reaches
            seen: dict[str, str] = {}
            todo = [(t, start) for t in self.imports[start].run | set(self.parents(start))]
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
                if mod in self.modules:
                    todo += [(t, mod) for t in self.imports[mod].top | set(self.parents(mod))]
        return sorted(set(bad))

    def torch_free_set(self) -> list[str]:
        roots = [m for m in self.modules if m.startswith(TORCH_FREE_ROOTS)]
        return sorted({*roots, *READERS})


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the deepest package listed there that holds ``module``."""
    best: tuple[int, int] | None = None  # (depth of the matching name, layer)
    for i, names in enumerate(LAYERS):
        for name in names:
            if module == name or module.startswith(name + "."):
                depth = name.count(".")
                if best is None or depth > best[0]:
                    best = (depth, i)
    return None if best is None else best[1]


GRAPH = Graph(ROOT)


def test_graph_sees_known_edges() -> None:
    """The walker itself: known imports of each level are found (else the checks prove nothing)."""
    core = GRAPH.imports["fitserve.engine.core"]
    assert "fitserve.engine.builder" in core.top and "torch" in core.top
    assert "fitserve.engine.calibrate" in core.lazy  # the slo policy's step model
    main = GRAPH.imports["fitserve.cli.main"]
    assert "fitserve.engine.core" in main.lazy and "fitserve.engine.core" not in main.top
    assert "fitserve.loading.hf_defaults" in GRAPH.imports["fitserve.loading.hf_config"].top
    loading = GRAPH.imports["fitserve.loading"]
    assert "fitserve.loading.gguf" in loading.lazy and "fitserve.loading.gguf" not in loading.top
    assert "fitserve.server.settings" in GRAPH.imports["fitserve.server.openapi"].typing
    assert "fitserve.tools.planner.cli" in main.lazy


def test_no_import_cycle_at_any_level() -> None:
    cycles = GRAPH.cycles()
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_serving_path_never_imports_tools() -> None:
    bad = GRAPH.serving_imports_of_tools()
    assert not bad, "fitserve.tools imported from the serving path:\n" + "\n".join(bad)


def test_every_package_is_in_a_layer() -> None:
    top = {".".join(m.split(".")[:2]) for m in GRAPH.modules} - {"fitserve"}
    assert not sorted(p for p in top if layer_of(p) is None), "add new packages to LAYERS"


def test_imports_go_down_the_layers() -> None:
    bad = GRAPH.upward_imports()
    assert not bad, "imports of a higher layer:\n" + "\n".join(bad)


def test_torch_free_parts_never_reach_torch() -> None:
    bad = GRAPH.torch_reached_from(GRAPH.torch_free_set())
    assert not bad, "torch reached from torch-free modules:\n" + "\n".join(bad)


def test_torch_free_at_run_time(tmp_path: Path) -> None:
    from tests.tiny_gguf import TinyGGUF, write_tiny_gguf

    gguf_file = write_tiny_gguf(tmp_path / "m.gguf", TinyGGUF(arch="qwen2", qkv_bias=True))
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 64, '
                                          '"intermediate_size": 96, "num_hidden_layers": 2, '
                                          '"num_attention_heads": 4, "vocab_size": 320}')
    code = (
        "import sys\n"
        "import fitserve.tools.planner.cli, fitserve.ledger.memory, fitserve.kv, fitserve.sched\n"
        f"import {', '.join(READERS)}\n"
        "from fitserve.tools.planner.model_source import resolve_model\n"
        "from fitserve.tools.planner.sections_run import build_plan\n"
        "from fitserve.tools.planner.report import PlanRequest\n"
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


def _planted_copy(tmp_path: Path, plants: dict[str, str]) -> Graph:
    """A copy of fitserve/ with ``plants`` (module path -> text) appended, and its graph."""
    shutil.copytree(PKG, tmp_path / "fitserve", ignore=shutil.ignore_patterns("__pycache__", "*.so",
                                                                             "*.cpp", "*.h"))
    for rel, text in plants.items():
        with (tmp_path / "fitserve" / rel).open("a") as f:
            f.write(text)
    return Graph(tmp_path)


def test_checks_catch_planted_cycles_at_every_level(tmp_path: Path) -> None:
    """A cycle closed by a function-level import and one closed by a TYPE_CHECKING import are
    both reported (the old check, module level only, saw neither)."""
    graph = _planted_copy(tmp_path, {
        # kv.block_pool is imported by kv.manager at module level; close it inside a function
        "kv/block_pool.py": "\n\ndef _planted():\n    from fitserve.kv.manager import KVCacheManager\n"
                            "    return KVCacheManager\n",
        # sched.request is imported by sched.scheduler; close it under TYPE_CHECKING
        "sched/request.py": "\n\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "    from fitserve.sched.scheduler import Scheduler\n",
    })
    found = {" -> ".join(c) for c in graph.cycles()}
    assert any("fitserve.kv.block_pool" in c and "fitserve.kv.manager" in c for c in found), found
    assert any("fitserve.sched.request" in c and "fitserve.sched.scheduler" in c
               for c in found), found
    assert not GRAPH.cycles()  # and the real tree has none


def test_checks_catch_a_serving_path_import_of_tools(tmp_path: Path) -> None:
    graph = _planted_copy(tmp_path, {
        "engine/outputs.py": "\n\ndef _planted():\n    from fitserve.tools.planner import cli\n"
                             "    return cli\n",
        "server/metrics.py": "\n\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from fitserve.tools.bench.loadgen import RequestResult\n",
    })
    bad = graph.serving_imports_of_tools()
    assert "fitserve.engine.outputs -> fitserve.tools.planner.cli" in bad, bad
    assert "fitserve.server.metrics -> fitserve.tools.bench.loadgen" in bad, bad
    assert not GRAPH.serving_imports_of_tools()


def test_checks_catch_an_upward_import(tmp_path: Path) -> None:
    graph = _planted_copy(tmp_path, {
        "runner/decode_loop.py": "\n\ndef _planted():\n    from fitserve.engine import core\n"
                                 "    return core\n",
        "kv/prefix_hash.py": "\n\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from fitserve.sched.request import SchedRequest\n",
    })
    bad = graph.upward_imports()
    assert "fitserve.runner.decode_loop -> fitserve.engine.core" in bad, bad
    assert "fitserve.kv.prefix_hash -> fitserve.sched.request" in bad, bad
    assert not GRAPH.upward_imports()


def test_checks_catch_torch_reached_from_the_ledger(tmp_path: Path) -> None:
    graph = _planted_copy(tmp_path, {"ledger/units.py": "\n\ndef _planted():\n"
                                                        "    from fitserve.model import layers\n"
                                                        "    return layers\n"})
    bad = graph.torch_reached_from(["fitserve.ledger.units"])
    assert any(b.startswith("torch <- ") and b.endswith("fitserve.ledger.units") for b in bad), bad
