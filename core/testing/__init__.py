"""``palestra.testing``: the contract test kit for plugin authors.

Each ``check_*`` takes a registered name (built through the registry, its options validated like a config's)
or a factory (called with the options as keyword arguments), exercises the contract the trainer relies on, and
raises a one-line :class:`ContractError` at the first broken rule, naming the plugin, the method and the rule::

    from palestra.testing import check_reward
    check_reward("keyword_coverage", environment="word_usage")
    # ContractError: reward 'keyword_coverage'.__call__: rule 'scores are a float tensor': returned a list of 4; ...

The rules, kind by kind, are in :data:`RULES` (and docs/testing-plugins.md). The kit is also a pytest plugin
(:mod:`palestra.testing.pytest_plugin`, loaded automatically where palestra is installed): a test asks for the
``palestra_contract`` fixture and calls ``palestra_contract("reward", "my_reward")``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from palestra.testing.agent import RULES as AGENT_RULES
from palestra.testing.agent import check_agent
from palestra.testing.environment import RULES as ENVIRONMENT_RULES
from palestra.testing.environment import check_environment
from palestra.testing.errors import ContractError
from palestra.testing.logger import RULES as LOGGER_RULES
from palestra.testing.logger import check_logger
from palestra.testing.optimizer import RULES as OPTIMIZER_RULES
from palestra.testing.optimizer import check_optimizer
from palestra.testing.policy import RULES as POLICY_RULES
from palestra.testing.policy import check_policy
from palestra.testing.reward import RULES as REWARD_RULES
from palestra.testing.reward import check_reward
from palestra.testing.tool import PARSER_RULES as TOOL_PARSER_RULES
from palestra.testing.tool import RULES as TOOL_RULES
from palestra.testing.tool import check_tool, check_tool_parser

__all__ = [
    "CHECKS",
    "RULES",
    "ContractError",
    "check",
    "check_agent",
    "check_environment",
    "check_logger",
    "check_optimizer",
    "check_policy",
    "check_reward",
    "check_tool",
    "check_tool_parser",
]

# kind -> its check; the kinds are the registry's (generators have no check of their own: check_policy samples
# through one).
CHECKS: dict[str, Callable[..., None]] = {
    "environment": check_environment,
    "reward": check_reward,
    "optimizer": check_optimizer,
    "policy": check_policy,
    "logger": check_logger,
    "tool": check_tool,
    "tool_parser": check_tool_parser,
    "agent": check_agent,
}

# kind -> rule name -> what the rule asks
RULES: dict[str, dict[str, str]] = {
    "environment": ENVIRONMENT_RULES,
    "reward": REWARD_RULES,
    "optimizer": OPTIMIZER_RULES,
    "policy": POLICY_RULES,
    "logger": LOGGER_RULES,
    "tool": TOOL_RULES,
    "tool_parser": TOOL_PARSER_RULES,
    "agent": AGENT_RULES,
}


def check(kind: str, component: str | Callable[..., Any], options: dict[str, Any] | None = None, **kwargs: Any) -> None:
    """``check_<kind>(component, options, **kwargs)``: the check for one kind of component, by the kind's name."""
    try:
        run = CHECKS[kind]
    except KeyError:
        raise ValueError(
            f"palestra.testing.check: no check for kind {kind!r}; the kinds are {', '.join(CHECKS)}"
        ) from None
    run(component, options, **kwargs)
