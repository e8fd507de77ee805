"""The layering written in ARCHITECTURE.md, checked on every module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvpool"

# First path component under kvpool/ (module or package) -> layer.
LAYERS = {
    "errors": 0,
    "build_info": 0,  # which build of the core runs (pure Python or compiled)
    "checks": 1,
    "secret_files": 1,  # the one reader and rule of secret files (tenancy and tier signatures ask it)
    "hashing": 2,
    "specs": 2,
    "stats": 2,
    "calibration": 2,  # kvpool calibrate: fits a cost profile to a live OpenAI server (httpx, the serve extra)
    "tenancy": 2,  # tenants, API keys and the cache salt derived for them (the server and the router ask it)
    "routing": 2,
    "model_names": 1,  # kvpool's model names -> their folders, torch-free (the engine converts; the router reads)
    "fair_share": 1,  # how tenants share the batch, the pool and a step (the scheduler asks it)
    "cost_model": 1,  # how long an engine step takes: named cost profiles (the simulator and the emulator ask it)
    "replica_rates": 2,  # how fast one replica works: GET /rates, the router's Replica.rates (from a cost profile too)
    "sampling_params": 2,  # a request's sampling options, their fields and ranges (torch-free; the engine samples)
    "prompts": 2,  # how a prompt becomes token IDs: the rule the engine, the server and the router follow
    "gguf_tokenizer": 2,  # a bundled model's tokenizer files written from its GGUF's metadata (no torch, no numpy)
    "block": 3,
    "events": 3,
    "kv_events": 4,  # KV events on the wire (vLLM's format); msgspec and pyzmq imported lazily
    "model_config": 3,
    "tokenizer_files": 3,  # a model folder's tokenizer and chat template, torch-free (the router and the emulator)
    "openai_http": 3,  # the OpenAI HTTP surface serve and route share: requests, auth, body limits, error bodies
    "request": 5,
    "linked_blocks": 5,
    "recurrent_state": 5,
    "free_queue": 6,
    "prefix_index": 6,
    "model_layers": 6,
    "eviction": 7,
    "block_pool": 7,
    "estimates": 7,
    "groups": 8,
    "planner": 8,
    "coordinator": 9,
    "invariants": 10,
    "manager": 11,
    "connector": 11,  # the KV connector interface (torch-free); its implementations live above
    "scheduler": 12,
    "tiers": 12,  # tier kinds, specs, stores, entries and the tier hierarchy connector (torch-free)
    "engine": 13,
    "sim": 13,
    "serve": 14,  # the OpenAI-compatible HTTP server over the engine
    "router": 14,  # kvpool route: the prefix-aware front door over replicas (torch-free; a sibling of serve)
    # replicas with no weights: the real scheduler and manager, time from a cost profile; torch-free, it takes what
    # requests return and stop strings from the engine's torch-free modules (engine.outputs, engine.stop_strings)
    "emulator": 14,
    "cli": 15,
    "integrations": 15,  # kvpool inside other servers (vLLM's KV connector); each imports its server only itself
    "__init__": 16,  # the package facade re-exports the core
}
TORCH_FREE_BELOW = 13


def component(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines inside ``if TYPE_CHECKING:`` blocks: imports there never run."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _is_module(name: str) -> bool:
    return (SRC / f"{name}.py").exists() or (SRC / name / "__init__.py").exists()


def kvpool_imports(path: Path) -> list[tuple[str, int]]:
    """Every import that runs (at module level or inside functions)."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "kvpool" and node.level == 0:
            # ``from kvpool import prompts`` imports the module kvpool.prompts; ``from kvpool import
            # KVCacheManager`` runs the package facade
            names = [f"kvpool.{alias.name}" if _is_module(alias.name) else "kvpool.__init__" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.extend((name, node.lineno) for name in names)
    return found


MODULES = sorted(p for p in SRC.rglob("*.py"))


def test_every_layer_is_a_whole_number():
    assert all(type(layer) is int for layer in LAYERS.values()), {k: v for k, v in LAYERS.items() if type(v) is not int}


def test_every_module_has_a_layer():
    assert {component(p) for p in MODULES} <= set(LAYERS), {component(p) for p in MODULES} - set(LAYERS)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_never_go_upwards(path):
    mine = component(path)
    for name, line in kvpool_imports(path):
        if not name.startswith("kvpool."):
            continue
        theirs = name.split(".")[1]
        if theirs == mine:
            continue
        assert LAYERS[theirs] <= LAYERS[mine], f"{path.name}:{line} imports {name} from a higher layer"
        if LAYERS[theirs] == LAYERS[mine]:
            pytest.fail(f"{path.name}:{line} imports {name}, a sibling of the same layer")


@pytest.mark.parametrize(
    "path", [p for p in MODULES if LAYERS[component(p)] < TORCH_FREE_BELOW], ids=lambda p: str(p.relative_to(SRC))
)
def test_nothing_below_the_engine_imports_torch(path):
    for name, line in kvpool_imports(path):
        assert name.split(".")[0] not in {"torch", "transformers", "numpy"}, f"{path.name}:{line} imports {name}"


def _module_name(path: Path) -> str:
    parts = ("kvpool", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _every_import(path: Path) -> set[str]:
    """kvpool modules a file names in any import: type-checking and function-level ones included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n == "kvpool" or n.startswith("kvpool.")}


def test_there_is_no_import_cycle_at_all():
    modules = {_module_name(p): p for p in MODULES}
    graph = {name: {m for m in _every_import(path) if m in modules and m != name} for name, path in modules.items()}
    # a package's own __init__ importing its submodules is how packages are built, not a cycle
    for name in graph:
        graph[name] = {m for m in graph[name] if not (m.startswith(name + ".") and modules[name].name == "__init__.py")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


# Layers numbered above what their imports need, and why: a layer groups a concept with its
# neighbours, never just sits high. Anything else must sit directly above its highest import.
ABOVE_WHAT_IMPORTS_NEED = {
    "stats": "counters the manager reports; beside hashing and specs, the core's plain records",
    "routing": "the replica choice beside tenancy: both rules the router and the simulator ask",
    "prompts": "the prompt rule beside tenancy: both rules every front door asks",
    "block": "the block record beside events: the pool's records",
    "request": "a request's tokens and keys beside linked_blocks: what the pool's tables hold",
    "linked_blocks": "free-list mechanics, one layer under the free queue and the eviction policies",
    "recurrent_state": "a Mamba layer's state beside request: sized before the layer rules use it",
    "prefix_index": "the index beside the free queue: the two halves of the pool",
    "invariants": "the bookkeeping checker, directly under the manager that calls it",
    "connector": "the KV connector interface beside the manager: the two faces a scheduler talks to",
    "router": "kvpool route beside kvpool serve: the two front doors, neither importing the other",
    "integrations": "kvpool inside other servers, at the top beside the commands",
    "__init__": "the package facade, above everything it may re-export",
}


def _needed_layers() -> dict[str, int]:
    needed: dict[str, int] = {}
    for path in MODULES:
        mine = component(path)
        for name, _ in kvpool_imports(path):
            if name.startswith("kvpool.") and (theirs := name.split(".")[1]) != mine:
                needed[mine] = max(needed.get(mine, 0), LAYERS[theirs] + 1)
    return needed


def test_a_layer_sits_directly_above_its_highest_import_unless_grouped():
    needed = _needed_layers()
    slack = {name: (layer, needed.get(name, 0)) for name, layer in LAYERS.items() if layer > needed.get(name, 0)}
    assert set(slack) - set(ABOVE_WHAT_IMPORTS_NEED) == set(), {
        name: f"layer {layer}, its imports need only {need}"
        for name, (layer, need) in slack.items()
        if name not in ABOVE_WHAT_IMPORTS_NEED
    }
    assert set(ABOVE_WHAT_IMPORTS_NEED) <= set(slack), set(ABOVE_WHAT_IMPORTS_NEED) - set(slack)


def test_from_kvpool_import_counts_as_importing_that_module(tmp_path):
    """``from kvpool import prompts`` is an import of kvpool.prompts; ``from kvpool import X`` of the facade."""
    found = {name for name, _ in kvpool_imports(SRC / "serve" / "tokenizer_thread.py")}
    assert "kvpool.prompts" in found
    facade = tmp_path / "facade.py"
    facade.write_text("from kvpool import KVCacheManager\n")
    assert [name for name, _ in kvpool_imports(facade)] == ["kvpool.__init__"]


def test_the_version_is_the_distributions():
    from importlib.metadata import version

    from kvpool.build_info import VERSION

    assert VERSION == version("kvpool")


def _defined_classes() -> dict[str, list[str]]:
    where: dict[str, list[str]] = {}
    for path in MODULES:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(path.relative_to(SRC)))
    return where


def test_no_class_name_is_defined_twice():
    """A name says which room it is in: two classes of one name are two rooms' words for different things."""
    twice = {name: paths for name, paths in _defined_classes().items() if len(paths) > 1}
    assert twice == {}


# Module names that say what a room holds only with their folder beside them: one of each.
ONE_OF_EACH = ("app.py", "prompts.py", "spec.py", "specs.py")


def test_module_names_that_need_their_folder_are_not_repeated():
    for stem in ONE_OF_EACH:
        found = [str(p.relative_to(SRC)) for p in MODULES if p.name == stem]
        assert len(found) <= 1, found
    specs = [str(p.relative_to(SRC)) for p in MODULES if p.name in {"spec.py", "specs.py"}]
    assert len(specs) <= 1, specs
