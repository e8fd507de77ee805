"""Fixtures shared by the core tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def system_prompt() -> list[int]:
    return list(range(100, 112))
