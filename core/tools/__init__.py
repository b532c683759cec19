"""Tools a model calls inside an episode: the tool and parser contracts, the call loop, the sandbox (docs/tools.md)."""

from __future__ import annotations

from palestra.tools.calls import ParsedTurn, ToolCall, ToolCallParser, decode_call
from palestra.tools.tool import Tool, ToolDefinitionError

__all__ = ["ParsedTurn", "Tool", "ToolCall", "ToolCallParser", "ToolDefinitionError", "decode_call"]
