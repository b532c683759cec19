"""The contract kit as a pytest plugin, so a plugin's own test suite gets it with no set-up.

palestra declares this module in the ``pytest11`` entry-point group, so pytest loads it wherever palestra is
installed. It provides one fixture::

    def test_my_reward_keeps_the_contract(palestra_contract):
        palestra_contract("reward", "my_reward", environment="my_env")

    def test_my_tool_keeps_the_contract(palestra_contract):
        palestra_contract("tool", "my_tool", examples=[{"city": "Paris"}])

``palestra_contract(kind, name_or_factory, options=None, **kwargs)`` runs ``palestra.testing.check_<kind>``
and turns a broken rule into a one-line test failure (no traceback: the line says it all). Loading this
module imports neither torch nor the kit; the fixture does, when a test asks for it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

__all__ = ["ContractChecker", "palestra_contract"]


class ContractChecker:
    """What the ``palestra_contract`` fixture gives a test: call it with a kind and a component."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path

    def __call__(
        self, kind: str, component: str | Callable[..., Any], options: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        from palestra.testing import ContractError, check

        if kind == "logger":
            kwargs.setdefault("run_dir", self.tmp_path / "contract-logger")  # pytest keeps it for inspection
        try:
            check(kind, component, options, **kwargs)
            return
        except ContractError as e:
            message = str(e)
        pytest.fail(message, pytrace=False)  # outside the except block: no "during handling ..." second copy


@pytest.fixture
def palestra_contract(tmp_path: Path) -> ContractChecker:
    """Check a component against palestra's contract: ``palestra_contract("reward", "my_reward")``."""
    return ContractChecker(tmp_path)
