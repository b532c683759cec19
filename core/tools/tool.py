"""A tool a model may call: a name, a description, its parameters as JSON Schema, and the callable that runs it.

A tool plugin registers a factory that returns one :class:`Tool` (or a list, for a server offering several).
:meth:`Tool.from_function` builds one from a plain function: the schema comes from its type hints and its
Google-style docstring, through transformers' ``get_json_schema`` (the same schema ``apply_chat_template(tools=...)``
renders), so a tool's description is written once, where its code is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Tool", "ToolDefinitionError", "check_tool_name"]

# What the chat templates and the OpenAI function format accept as a function name.
NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")


class ToolDefinitionError(ValueError):
    """A tool is defined wrongly (a bad name, a schema that is not an object schema, an undocumented parameter).
    One line naming the tool."""

    palestra_user_error = True


def check_tool_name(name: str, *, where: str) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ToolDefinitionError(
            f"{where}: a tool name is 1-64 letters, digits, '_', '.' or '-', starting with a letter or '_'; "
            f"got {name!r}"
        )
    return name


@dataclass(frozen=True)
class Tool:
    """A callable offered to a model.

    ``fn`` is called with the model's arguments as keyword arguments, once they match ``parameters`` (a JSON
    Schema of type ``object``), and returns the result: a string, or anything ``json.dumps`` takes. It runs in the
    trainer's process, so it must be trusted code: what a *model* writes (code) runs only through a tool that
    sandboxes it, like the built-in ``python`` tool. ``timeout_s`` bounds one call: past it the model is told the
    call timed out (the tool's own work may go on in a daemon thread; a tool that can hang should stop itself).
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any] = field(compare=False)
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        check_tool_name(self.name, where=f"tool {self.name!r}")
        if not isinstance(self.description, str):
            raise ToolDefinitionError(f"tool {self.name!r}: description must be a string")
        if not isinstance(self.parameters, Mapping) or self.parameters.get("type") != "object":
            raise ToolDefinitionError(
                f"tool {self.name!r}: parameters must be a JSON Schema of type 'object', got {self.parameters!r:.120}"
            )
        if not callable(self.fn):
            raise ToolDefinitionError(f"tool {self.name!r}: fn must be callable, got {type(self.fn).__name__}")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ToolDefinitionError(
                f"tool {self.name!r}: timeout_s must be a positive number, got {self.timeout_s!r}"
            )

    @classmethod
    def from_function(
        cls,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float = 10.0,
    ) -> Tool:
        """A tool from a function with type hints and a Google-style docstring (``Args:`` documents every
        parameter). ``name`` and ``description`` default to the function's name and the docstring's first part."""
        try:
            from transformers.utils import get_json_schema
        except ImportError as e:
            from palestra.registry import MissingDependency

            raise MissingDependency(
                "Tool.from_function", "transformers", 'pip install "palestra[tools]"', cause=e
            ) from None
        label = name or getattr(fn, "__name__", type(fn).__name__)
        try:
            schema = get_json_schema(fn)["function"]
        except Exception as e:  # noqa: BLE001 - transformers' DocstringParsingException, TypeHintParsingException
            text = " ".join(str(e).split())
            raise ToolDefinitionError(
                f"tool {label!r}: cannot derive its JSON Schema from {fn!r:.80}: {text}"
            ) from None
        return cls(
            name=name or schema["name"],
            description=description if description is not None else schema.get("description", ""),
            parameters=dict(schema.get("parameters") or {"type": "object", "properties": {}}),
            fn=fn,
            timeout_s=timeout_s,
        )

    def spec(self) -> dict[str, Any]:
        """The OpenAI function spec: what ``apply_chat_template(tools=[...])`` and the tool prompts render."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def argument_error(self, arguments: Any) -> str | None:
        """Why ``arguments`` do not fit ``parameters`` (one line, naming the argument), or None when they do."""
        if not isinstance(arguments, Mapping):
            return f"the arguments must be a JSON object, got {type(arguments).__name__}"
        try:
            import jsonschema
        except ImportError as e:
            from palestra.registry import MissingDependency

            raise MissingDependency(
                "checking tool arguments", "jsonschema", 'pip install "palestra[tools]"', cause=e
            ) from None
        validator = jsonschema.Draft202012Validator(self.parameters)
        errors = sorted(validator.iter_errors(dict(arguments)), key=lambda e: [str(p) for p in e.absolute_path])
        if not errors:
            return None
        lines = []
        for error in errors[:3]:
            where = ".".join(str(p) for p in error.absolute_path)
            lines.append(f"argument {where!r}: {error.message}" if where else error.message)
        return "; ".join(lines)
