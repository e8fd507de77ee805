"""setuptools' build backend, plus mypy as a build requirement when ``KVPOOL_COMPILE=1``.

``pip install .`` builds in an isolated environment from the requirements a
backend names; the compiled build needs mypyc (part of mypy), the pure one
nothing beyond setuptools, so the list depends on the variable that
``setup.py`` reads.
"""

from __future__ import annotations

import os
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  # every hook not redefined below is setuptools' own

#: The mypy (mypyc) that compiles the core: the version the test extra checks types with.
MYPYC_REQUIREMENT = "mypy==1.19.1"


def _extra() -> list[str]:
    return [MYPYC_REQUIREMENT] if os.environ.get("KVPOOL_COMPILE", "").strip() == "1" else []


def _without_extensions(hook: Any, config_settings: dict[str, Any] | None) -> list[str]:
    """Run setuptools' hook, which runs setup.py, with setup.py told not to reach for mypyc (not installed yet)."""
    os.environ[LISTING_REQUIREMENTS] = "1"
    try:
        return list(hook(config_settings))
    finally:
        del os.environ[LISTING_REQUIREMENTS]


#: Set while setuptools runs setup.py only to list build requirements.
LISTING_REQUIREMENTS = "KVPOOL_LISTING_BUILD_REQUIREMENTS"


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    return _without_extensions(_setuptools.get_requires_for_build_wheel, config_settings) + _extra()


def get_requires_for_build_editable(config_settings: dict[str, Any] | None = None) -> list[str]:
    return _without_extensions(_setuptools.get_requires_for_build_editable, config_settings) + _extra()
