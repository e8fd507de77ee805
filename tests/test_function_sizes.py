"""The front doors stay readable: no function or class in them grows back into a wall of closures.

``kvpool serve``'s app and ``kvpool route``'s router were once a 155-line ``build_app`` of
closures and a 390-line ``Router``; their routes now live on named handler classes and the
router is a facade over its parts. These limits hold the line: a function past
:data:`MAX_FUNCTION_LINES` or a class past :data:`MAX_CLASS_LINES` (docstrings and comments
included) is asking to be split, by concept, into a collaborator of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvpool"

MAX_FUNCTION_LINES = 50
MAX_CLASS_LINES = 200

#: The HTTP front doors and the modules their handlers and collaborators live in.
FRONT_DOORS = (
    "serve/openai_server.py",
    "serve/server_state.py",
    "serve/generation_routes.py",
    "serve/model_routes.py",
    "serve/operator_routes.py",
    "router/front_door.py",
    "router/route_options.py",
    "router/ranking.py",
    "router/bookkeeping.py",
    "router/relay.py",
    "sim/sweep.py",
    "sim/sweep_executors.py",
    "sim/sweep_results.py",
    "sim/sweep_runner.py",
)


def _sizes(path: Path) -> list[tuple[str, str, int]]:
    """Every function and class in ``path`` (nested ones too): its kind, qualified-ish name and lines."""
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                assert child.end_lineno is not None
                name = f"{prefix}{child.name}"
                found.append((kind, name, child.end_lineno - child.lineno + 1))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), filename=str(path)), "")
    return found


@pytest.mark.parametrize("module", FRONT_DOORS)
def test_no_function_or_class_is_too_long(module: str) -> None:
    path = SRC / module
    too_long = [
        f"{kind} {name}: {lines} lines"
        for kind, name, lines in _sizes(path)
        if lines > (MAX_CLASS_LINES if kind == "class" else MAX_FUNCTION_LINES)
    ]
    assert not too_long, (
        f"{module}: past {MAX_FUNCTION_LINES} lines a function, {MAX_CLASS_LINES} a class: {too_long}; "
        "split it by concept (a handler class per route group, a collaborator per job)"
    )


def test_the_limits_catch_a_wall_of_closures(tmp_path: Path) -> None:
    """The check sees nested functions and methods, so a ``build_app`` of closures cannot hide."""
    body = "\n".join(f"            x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = tmp_path / "walled.py"
    source.write_text(f"class Door:\n    def build(self):\n        def route():\n{body}\n        return route\n")
    sizes = {name: lines for _, name, lines in _sizes(source)}
    assert sizes["Door.build.route"] == MAX_FUNCTION_LINES + 1
    assert sizes["Door.build"] > MAX_FUNCTION_LINES
