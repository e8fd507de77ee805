"""The commands map flags to library options and hold no rule of their own (issue 30).

``serve`` and ``route`` read as a short mapping: their flags arrive grouped
(``**flags``, taken into typed records by :func:`kvpool.cli.shared_flags.take`),
and each rule they used to hold is asked of the module that owns it: the salt
policy of :mod:`kvpool.tenancy`, vLLM's ``--kv-events-config`` and what a
``BlockStored`` may carry of :mod:`kvpool.kv_events`, the replica list of
:mod:`kvpool.router.replica_config`, the default model of :mod:`kvpool.model_names`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvpool.cli

CLI = Path(kvpool.cli.__file__).parent
#: The command modules this test holds to the rule (simulate and plan are not yet among them).
MODULES = ("serve.py", "route.py", "generate.py", "shared_flags.py")
#: The longest a command function may be, its decorators aside (serve was 116 lines, route 101).
MAX_LINES = 40

#: Rules the commands held once; their homes are named in the module docstring.
MOVED_DEFINITIONS = {"_vllm_events_config", "_VLLM_EVENT_KEYS", "_key_ring", "_engine_flags", "_DEFAULT_MODEL"}
#: What only a rule's home uses: a command that names one of these decides for itself.
RULE_CALLS = {
    ("SaltPolicy", "shared"),  # SaltPolicy.from_options chooses
    ("SaltPolicy", "isolated"),
    ("EventContent", "FULL"),  # EventContent.for_tenants chooses (serve reads HASHES only to say which it got)
    ("json", "loads"),  # vLLM's JSON is read by kv_events.vllm_config
}
RULE_NAMES = {"load_secret", "check_distinct", "parse_replica", "load_config"}


def _tree(name: str) -> ast.Module:
    return ast.parse((CLI / name).read_text(encoding="utf-8"))


def _function(name: str, module: str) -> ast.FunctionDef:
    found = [n for n in _tree(module).body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, f"{module} defines {name} {len(found)} times"
    return found[0]


@pytest.mark.parametrize(("command", "module", "named"), [("serve", "serve.py", 1), ("route", "route.py", 0)])
def test_a_command_is_a_short_mapping_of_grouped_flags(command: str, module: str, named: int) -> None:
    function = _function(command, module)
    assert function.end_lineno is not None
    lines = function.end_lineno - function.lineno + 1
    assert lines <= MAX_LINES, f"{command}() is {lines} lines: move what it decides into the library"
    arguments = function.args
    assert len(arguments.args) + len(arguments.kwonlyargs) == named, f"{command}() takes its flags one by one"
    assert arguments.kwarg is not None and arguments.kwarg.arg == "flags"


@pytest.mark.parametrize("module", MODULES)
def test_the_commands_define_none_of_the_moved_rules(module: str) -> None:
    tree = _tree(module)
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assigned = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assert not (defined | assigned) & MOVED_DEFINITIONS


@pytest.mark.parametrize("module", MODULES)
def test_the_commands_ask_the_rules_home_instead_of_deciding(module: str) -> None:
    tree = _tree(module)
    attributes = {
        (n.value.id, n.attr) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
    }
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not attributes & RULE_CALLS, f"{module} decides {sorted(attributes & RULE_CALLS)} itself"
    assert not (names | imported) & RULE_NAMES, f"{module} uses {sorted((names | imported) & RULE_NAMES)}"


@pytest.mark.parametrize("module", MODULES)
def test_the_default_model_is_named_once_in_model_names(module: str) -> None:
    from kvpool.model_names import DEFAULT_MODEL

    strings = {n.value for n in ast.walk(_tree(module)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert DEFAULT_MODEL not in strings


def test_the_engine_flags_are_defined_once_and_every_engine_command_takes_them() -> None:
    from click.testing import CliRunner

    from kvpool.cli.commands import cli
    from kvpool.cli.shared_flags import ENGINE_FLAGS, ENGINE_OPTIONS

    assert ENGINE_FLAGS == tuple(ENGINE_OPTIONS)
    for command in ("generate", "chat", "serve"):
        params = {p.name for p in cli.commands[command].params}  # type: ignore[attr-defined]
        assert set(ENGINE_FLAGS) <= params, f"{command} lacks {set(ENGINE_FLAGS) - params}"
    assert "--kv-tier-namespace" in CliRunner().invoke(cli, ["serve", "--help"]).output


def test_the_tenant_flags_are_the_same_flags_on_serve_and_route() -> None:
    from kvpool.cli.commands import cli
    from kvpool.cli.shared_flags import TenantFlags

    names = {f for f in TenantFlags.__dataclass_fields__}
    for command in ("serve", "route"):
        options = {p.name: p for p in cli.commands[command].params}  # type: ignore[attr-defined]
        assert names <= set(options)
        assert options["no_tenant_isolation"].is_flag  # type: ignore[attr-defined]
