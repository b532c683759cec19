"""The one-line errors of the config tree: each message starts with the full dotted path of the culprit."""

from __future__ import annotations


# ---- errors ------------------------------------------------------------------------------------------
class ConfigError(ValueError):
    """A configuration problem. The message is one line that starts with the dotted path of the culprit."""

    palestra_user_error = True

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))  # one line, whatever went into it


class OptionError(ConfigError):
    """Raised by an options dataclass's ``__post_init__``: ``key`` is relative to the dataclass
    (``"layers[0].weight"``)."""

    def __init__(self, key: str, message: str) -> None:
        self.key, self.message = key, " ".join(str(message).split())
        super().__init__(f"{key}: {self.message}")


class ComponentBuildError(ConfigError):
    """A component's factory raised while building it from its (valid) config node."""
