"""The walls of the layout (docs/architecture.md), held by check rather than by prose:
- every module of `jaxpaged/core/` imports in a fresh interpreter where jax cannot be imported;
- no import cycle among the modules of jaxpaged/, serve/ and pallas_kernels/ (the benchmarks in
  jaxpaged/bench/ too), counting every import statement, also the ones inside functions;
- the engine never imports the benchmarks: only `jaxpaged bench` (jaxpaged/cli.py) and jaxpaged/bench/ itself;
- each folder sits on one side of jaxpaged/engine.py: below it (what the engine imports) or above it
  (what imports the engine), never both;
- `from jaxpaged import ...` still gives the public API, without importing jax until a name is used.


- `from jaxpaged import ...` still gives the public API, without importing jax until a name is used;
- one owner per state: only the scheduler writes a request's `token_ids` (docs/architecture.md, "Seams").
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jaxpaged", "serve", "pallas_kernels")

BLOCK_JAX = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('jax', 'jaxlib', 'flax', 'orbax'):
            raise ImportError(f'{name} is blocked: jaxpaged.core must not import it')
sys.meta_path.insert(0, Block())
"""


def _modules(root_dir: str) -> dict[str, str]:
    """{dotted module name: path} of the .py files under root_dir."""
    out = {}
    for dirpath, _, files in os.walk(root_dir):
        if "__pycache__" in dirpath:
            continue
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(dirpath, f)
    return out


def _core_modules() -> list[str]:
    return sorted(m for m in _modules(os.path.join(ROOT, "jaxpaged", "core")) if m != "jaxpaged.core")


@pytest.mark.parametrize("module", _core_modules())
def test_core_imports_without_jax(module):
    code = BLOCK_JAX + f"import {module}\nassert 'jax' not in sys.modules\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{module} needs jax (or fails to import):\n{r.stderr[-2000:]}"


def test_the_block_catches_jax():
    """The check above can fail: a module that imports jax is refused under the same block."""
    r = subprocess.run([sys.executable, "-c", BLOCK_JAX + "import jaxpaged.step.sampler\n"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "blocked" in r.stderr


def test_public_api_is_lazy():
    code = BLOCK_JAX + "import jaxpaged\nassert sorted(jaxpaged.__all__) == sorted(%r)\n" % [
        "LLM", "LLMEngine", "SamplingParams", "EngineConfig", "ModelConfig", "RequestOutput",
        "CompletionOutput", "StructuredOutputsParams", "LoRARequest", "BeamSearchParams", "BeamSearchOutput",
        "BeamSearchSequence", "PoolingParams"]
    code += ("from jaxpaged import SamplingParams, RequestOutput, StructuredOutputsParams, LoRARequest\n"
             "from jaxpaged import BeamSearchParams, BeamSearchOutput\n"
             "SamplingParams(max_tokens=3)\nBeamSearchParams(beam_width=2, max_tokens=3)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    import jaxpaged
    from jaxpaged import LLM, EngineConfig, LLMEngine, ModelConfig  # noqa: F401 -- the names resolve
    assert jaxpaged.LLM is LLM
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        jaxpaged.nope  # noqa: B018


def _imports(path: str, module: str, known: set[str]) -> set[str]:
    """The known modules `path` imports anywhere in its body (absolute and relative imports)."""
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    out = set()

    def add(name: str) -> None:
        while name and name not in known:  # `import a.b.c` of a module under a package: keep the module
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:  # `from pkg import mod` imports the module pkg.mod
                add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def import_graph() -> dict[str, set[str]]:
    mods = {}
    for p in PACKAGES:
        mods.update(_modules(os.path.join(ROOT, p)))
    known = set(mods)
    return {m: _imports(path, m, known) for m, path in mods.items()}


def test_no_import_cycles():
    graph = import_graph()
    assert "jaxpaged.core.scheduler" in graph and "jaxpaged.bench.throughput" in graph
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_engine_never_imports_the_benchmarks():
    bench = lambda m: m == "jaxpaged.bench" or m.startswith("jaxpaged.bench.")  # noqa: E731
    users = {m for m, deps in import_graph().items() if not bench(m) and any(bench(d) for d in deps)}
    assert users == {"jaxpaged.cli"}, users


def test_cycle_check_can_fail():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_core_imports_nothing_above_it():
    """core/ is the floor: it imports only other core modules (and jaxpaged's package file)."""
    graph = import_graph()
    for m, deps in graph.items():
        if m.startswith("jaxpaged.core."):
            above = sorted(d for d in deps if d.startswith(PACKAGES) and not d.startswith("jaxpaged.core")
                           and d != "jaxpaged")
            assert not above, f"{m} imports {above}"


def private_reaches(path: str) -> list[str]:
    """`obj._name` in the file at `path` where obj is not self / cls nor a name imported from outside
    jaxpaged, serve and pallas_kernels (a third party's internals, e.g. jax's, are its own affair)."""
    tree = ast.parse(open(path).read(), path)
    foreign = {"self", "cls"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mod, level = (node.module or "", node.level) if isinstance(node, ast.ImportFrom) else (None, 0)
            for a in node.names:
                if not (mod or a.name).startswith(PACKAGES) and not level:
                    foreign.add(a.asname or a.name.split(".")[0])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute | ast.Call | ast.Subscript):
                root = root.value if not isinstance(root, ast.Call) else root.func
            if not (isinstance(root, ast.Name) and root.id in foreign):
                out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: .{node.attr}")
    return out


def test_the_workshop_uses_public_names():
    """The benchmarks time and drive the engine through its public names (ModelRunner.wrap_steps for the
    step), never its private members."""
    bench = _modules(os.path.join(ROOT, "jaxpaged", "bench"))
    assert "jaxpaged.bench.host" in bench
    found = [hit for path in bench.values() for hit in private_reaches(path)]
    assert not found, found


def test_private_reach_check_can_fail(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("from jax._src.lib import xla_client\nimport numpy as np\n\n"
                 "def f(runner, self):\n    xla_client._xla\n    np._x\n    self._own\n    runner._compiled.get(1)\n")
    assert private_reaches(str(p)) == [f"{os.path.relpath(str(p), ROOT)}:8: ._compiled"]


def _workshop(m: str) -> bool:
    return any(m == p or m.startswith(p + ".") for p in ("jaxpaged.bench", "jaxpaged.testing"))


def test_engine_never_imports_the_workshop():
    """The library stands alone: only `jaxpaged bench` (jaxpaged/cli.py) imports the benchmarks or the shared
    test fixtures (jaxpaged/testing/); the benchmarks may import the fixtures, the fixtures never the benchmarks."""
    graph = import_graph()
    assert "jaxpaged.testing.tiny_models" in graph
    users = {m for m, deps in graph.items() if not _workshop(m) and any(_workshop(d) for d in deps)}
    assert users == {"jaxpaged.cli"}, users
    fixtures = [m for m in graph if m.startswith("jaxpaged.testing")]
    assert not [(m, d) for m in fixtures for d in graph[m] if d.startswith("jaxpaged.bench")]


ENGINE = "jaxpaged.engine"


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def engine_sides(graph: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """{folder: {"below": its modules the engine imports (directly or not), "above": its modules that import
    the engine}}, by the folder holding each module's file (a package file is in its own folder); jaxpaged's
    top-level modules (the engine's siblings) are not in a folder."""
    below, above = _reach(graph, ENGINE), {m for m in graph if ENGINE in _reach(graph, m)}
    paths = {m: p for pkg in PACKAGES for m, p in _modules(os.path.join(ROOT, pkg)).items()}
    sides: dict[str, dict[str, list[str]]] = {}
    for m in sorted(graph):
        folder = os.path.relpath(os.path.dirname(paths[m]), ROOT)
        if folder == "jaxpaged":
            continue
        entry = sides.setdefault(folder, {"below": [], "above": []})
        for side, members in (("below", below), ("above", above)):
            if m in members:
                entry[side].append(m)
    return sides


def test_each_folder_on_one_side_of_the_engine():
    """Every folder is either built into the engine (imported by jaxpaged/engine.py, directly or not) or built
    on it (imports it), never both: no folder holds modules on both sides (imports inside functions count)."""
    sides = engine_sides(import_graph())
    assert sides["jaxpaged/step"]["below"] and sides["jaxpaged/parallel"]["above"] and sides["serve"]["above"]
    both = {f: s for f, s in sides.items() if s["below"] and s["above"]}
    assert not both, f"folders on both sides of {ENGINE}: {both}"


# -- one owner per state: only the scheduler writes a request's tokens --------------------------------------
TOKEN_OWNERS = {"jaxpaged/core/scheduler.py"}
# a benchmark that times the grammar masks drives detached requests (no scheduler, no engine)
TOKEN_WRITERS_OUTSIDE_THE_ENGINE = {"jaxpaged/bench/grammar.py"}
LIST_MUTATORS = {"append", "extend", "insert", "pop", "clear", "remove", "sort", "reverse", "__setitem__",
                 "__delitem__", "__iadd__"}


def _is_tokens(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "token_ids"


def _written(target) -> bool:
    """An assignment or `del` target that changes a `.token_ids` list in place: an item or a slice of it
    (`x.token_ids[i] = ...`, `del x.token_ids[i:]`), also inside a tuple target."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_written(t) for t in target.elts)
    if isinstance(target, ast.Starred):
        return _written(target.value)
    return isinstance(target, ast.Subscript) and _is_tokens(target.value)


def token_writes(source: str) -> list[int]:
    """Lines of `source` that mutate some object's `.token_ids` list: a list method that changes it
    (`.append`, `.extend`, `.insert`, `.pop`, `.clear`, ...), `+=` (or any augmented assignment), item or
    slice assignment, `del` of it or of an item or slice. (Aliases, `ids = r.token_ids; ids.append(t)`, are
    not followed: the rule is held where a write names the field.)"""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in LIST_MUTATORS and _is_tokens(node.func.value):
            lines.append(node.lineno)
        elif isinstance(node, ast.AugAssign) and (_is_tokens(node.target) or _written(node.target)):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_written(t) for t in targets):
                lines.append(node.lineno)
        elif isinstance(node, ast.Delete) and any(_is_tokens(t) or _written(t) for t in node.targets):
            lines.append(node.lineno)
    return sorted(lines)


def test_only_the_scheduler_writes_tokens():
    """No module of jaxpaged/ or serve/ but the scheduler's mutates a request's `token_ids`: the runner
    reports (core/step_result.StepResult), speculative verification reports what it accepted
    (`Acceptance`), the output processor reports the finishes (`Finish`, with the stop-string and rejection
    trims), and the scheduler alone commits them."""
    found = {}
    for package in ("jaxpaged", "serve"):
        for path in _modules(os.path.join(ROOT, package)).values():
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            with open(path, encoding="utf-8") as f:
                lines = token_writes(f.read())
            if lines:
                found[rel] = lines
    assert "jaxpaged/core/scheduler.py" in found  # the walk reaches the owner, whose writes it sees
    others = {p: lines for p, lines in found.items() if p not in TOKEN_OWNERS | TOKEN_WRITERS_OUTSIDE_THE_ENGINE}
    assert not others, f"request tokens written outside the scheduler (file: lines): {others}"


def test_token_write_check_can_fail():
    """Each form of write is caught; reading, copying or rebinding another field is not."""
    writes = """
r.token_ids.append(t)
r.token_ids.extend(ts)
r.token_ids += ts
r.token_ids[i] = t
r.token_ids[-n:] = []
tail, r.token_ids[-n:] = r.token_ids[-n:], []
del r.token_ids[k:]
r.token_ids.pop()
r.token_ids.insert(0, t)
r.token_ids.clear()
"""
    reads = """
n = len(r.token_ids)
t = r.token_ids[-1]
ids = list(r.token_ids)
r.prompt_token_ids.append(t)
r.spec_token_ids[k:] = []
out = f(r.token_ids)
"""
    assert token_writes(writes) == list(range(2, 12))
    assert token_writes(reads) == []
