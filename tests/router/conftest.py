"""Fixtures the router's test modules share: test_feed's hand-driven publisher and event loop.

Imported here rather than named in a module's ``pytest_plugins``, which pytest skips for a module
it has collected already (test_feed.py itself), so a run of the whole folder lost them.
"""

from tests.router.test_feed import loop, publisher

__all__ = ["loop", "publisher"]
