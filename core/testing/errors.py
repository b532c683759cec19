"""How the kit reports a broken contract: one :class:`ContractError` line naming the plugin, the method and the rule.

``environment 'keyword_env'.reset: rule 'one observation per row': returned 3 observations for batch_size=2,
group_size=2`` — the shape of gymnasium's ``check_env`` and PettingZoo's ``api_test`` messages, so a plugin
author reads what is wrong without a traceback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

__all__ = ["Contract", "ContractError"]


class ContractError(AssertionError):
    """A component broke a rule of the contract the trainer relies on. The message is one line.

    An ``AssertionError`` so that pytest reports it as a test failure; ``palestra_user_error`` so that the
    command line prints the line alone.
    """

    palestra_user_error = True

    def __init__(self, message: str, *, kind: str = "", label: str = "", method: str = "", rule: str = "") -> None:
        super().__init__(" ".join(str(message).split()))
        self.kind, self.label, self.method, self.rule = kind, label, method, rule


@dataclass(frozen=True)
class Contract:
    """The rules of one kind of component, applied to one component (its ``label`` prefixes every failure).

    ``rules`` maps each rule's name to what it asks; a failure must name one of them, so every message the
    kit can print is a documented rule (docs/testing-plugins.md has the table).
    """

    kind: str
    label: str
    rules: Mapping[str, str]

    def fail(self, method: str, rule: str, detail: str) -> ContractError:
        """The error to raise: ``raise contract.fail("reset", "one observation per row", "returned 3 ...")``."""
        if rule not in self.rules:  # a typo in the kit itself, not the plugin's fault
            raise KeyError(f"palestra.testing: {self.kind} rule {rule!r} is not declared")
        return ContractError(
            f"{self.kind} {self.label!r}.{method}: rule {rule!r}: {detail}",
            kind=self.kind,
            label=self.label,
            method=method,
            rule=rule,
        )

    def require(self, condition: object, method: str, rule: str, detail: str) -> None:
        if not condition:
            raise self.fail(method, rule, detail)

    @contextlib.contextmanager
    def calling(self, method: str, rule: str) -> Iterator[None]:
        """Run a call of the component; an exception it raises becomes a failure of ``rule``.

        The original exception stays chained (``raise ... from``) for whoever wants the traceback.
        """
        try:
            yield
        except ContractError:
            raise
        except Exception as e:
            raise self.fail(method, rule, f"raised {type(e).__name__}: {_first_line(e)}") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines() or [""])[0][:300]
