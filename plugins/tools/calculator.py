"""The built-in ``calculator`` tool: arithmetic a model asks for, evaluated by walking the expression's syntax tree.

Numbers (ints and floats), ``+ - * / // % **``, unary ``+``/``-`` and parentheses; nothing else. There is no
``eval``: a name, a call, an attribute, a string or a comparison is refused before anything runs. Every value is
bounded: a number (written or computed) of more than ``max_digits`` digits is refused, and a power is refused
*before* it is computed when its result would be too long, so ``9**9**9`` answers at once. A refusal, a division by
zero or a syntax error raises ``ValueError`` with one line, which the tool loop hands back to the model.

The result is a string: an int when exact (``"6"``, also for ``12/2``), a float rounded to 10 significant digits
otherwise (``"0.3333333333"``).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from palestra import hookimpl, option
from palestra.registry import Requires
from palestra.tools import Tool

Number = int | float

_BINARY: dict[type[ast.operator], tuple[str, Callable[[Any, Any], Any]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
    ast.FloorDiv: ("//", operator.floordiv),
    ast.Mod: ("%", operator.mod),
    ast.Pow: ("**", operator.pow),
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}

# Python's ast names for what a model may try, said in words in the refusal.
_REFUSED = {
    ast.Name: "a name",
    ast.Call: "a function call",
    ast.Attribute: "an attribute",
    ast.Subscript: "an index",
    ast.Compare: "a comparison",
    ast.BoolOp: "and/or",
    ast.Lambda: "a lambda",
}


@dataclass
class CalculatorOptions:
    """Options of the ``calculator`` tool (a config sets them under ``tools.tools[i].options``)."""

    # The longest number, written or computed, in decimal digits (under Python's 4300-digit int-to-str limit).
    max_digits: int = option(30, ge=1, le=4000)
    max_length: int = option(1000, ge=1, le=100_000)  # the longest expression, in characters
    timeout_s: float = option(5.0, gt=0)  # one call's wall-clock limit (the tool loop enforces it)


MAX_DEPTH = 500  # operators deep: a sum of 500 terms (the longest a 1000-character expression holds) passes


class Calculator:
    """Evaluates one expression within the bounds of :class:`CalculatorOptions`."""

    def __init__(self, max_digits: int = 30, max_length: int = 1000) -> None:
        self.max_digits, self.max_length = max_digits, max_length
        self.limit = 10**max_digits  # a magnitude at or above this has more than max_digits digits

    def __call__(self, expression: str) -> str:
        if not isinstance(expression, str):
            raise ValueError(f"the expression must be a string, got {type(expression).__name__}")
        if len(expression) > self.max_length:
            raise ValueError(
                f"the expression is {len(expression)} characters long; the calculator takes at most {self.max_length}"
            )
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError as e:
            where = f" at character {e.offset}" if e.offset else ""
            raise ValueError(f"not an arithmetic expression ({e.msg}{where}): {expression.strip()[:80]!r}") from None
        except (RecursionError, MemoryError):  # the parser's own nesting limits
            raise ValueError("the expression nests too deeply") from None
        try:
            return render(self.walk(tree.body, 0))
        except RecursionError:
            raise ValueError("the expression nests too deeply") from None

    def walk(self, node: ast.AST, depth: int) -> Number:
        # An explicit bound, not only RecursionError: a library can raise the interpreter's recursion limit (torch's
        # compiler does), and the refusal must not depend on what else the process has imported.
        if depth > MAX_DEPTH:
            raise ValueError("the expression nests too deeply")
        if isinstance(node, ast.Constant):
            return self.bounded(self.literal(node.value), "the number")
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self.walk(node.operand, depth + 1))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            symbol, fn = _BINARY[type(node.op)]
            left, right = self.walk(node.left, depth + 1), self.walk(node.right, depth + 1)
            if symbol == "**":
                self.check_power(left, right)
            return self.bounded(self.apply(fn, left, right, symbol), f"the result of {symbol}")
        what = _REFUSED.get(type(node), f"{type(node).__name__}")
        raise ValueError(f"the calculator takes numbers, + - * / // % ** and parentheses only, not {what}")

    @staticmethod
    def literal(value: Any) -> Number:
        # bool is an int subclass: True/False are names in an expression, not numbers.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        raise ValueError(f"the calculator takes numbers only, not {value!r:.40}")

    def check_power(self, base: Number, exponent: Number) -> None:
        """Refuse ``base ** exponent`` before computing it when its magnitude would pass the limit: its number of
        digits is about ``exponent * log10(|base|)``."""
        if base == 0 or not math.isfinite(exponent):
            return
        digits = float(exponent) * math.log10(abs(base))
        if digits >= self.max_digits:
            raise ValueError(
                f"{_short(base)}**{_short(exponent)} would have about {_count(digits)} digits; "
                f"the calculator stops at {self.max_digits}"
            )

    @staticmethod
    def apply(fn: Callable[[Any, Any], Any], left: Number, right: Number, symbol: str) -> Any:
        try:
            return fn(left, right)
        except ZeroDivisionError:
            raise ValueError(f"division by zero ({_short(left)} {symbol} {_short(right)})") from None
        except OverflowError:
            raise ValueError(f"{_short(left)} {symbol} {_short(right)} is too large") from None

    def bounded(self, value: Any, what: str) -> Number:
        if isinstance(value, complex):  # (-8) ** 0.5
            raise ValueError(f"{what} is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{what} is not a finite number")
        if abs(value) >= self.limit:
            raise ValueError(f"{what} has more than {self.max_digits} digits, the calculator's limit")
        return value


def render(value: Number) -> str:
    """An int as it is; a float rounded to 10 significant digits, written as an int when that is exact."""
    if isinstance(value, int):
        return str(value)
    rounded = float(f"{value:.10g}")
    if rounded.is_integer() and abs(rounded) < 1e15:
        return str(int(rounded))
    return f"{rounded:.10g}"


def _short(value: Number) -> str:
    text = render(value)
    return text if len(text) <= 24 else text[:10] + "..." + text[-6:]


def _count(digits: float) -> str:
    return f"{int(digits) + 1}" if digits < 1e15 else f"{digits:.3g}"


def calculator(max_digits: int = 30, max_length: int = 1000, timeout_s: float = 5.0) -> Tool:
    """The ``calculator`` tool (its schema from :func:`_calculate`'s type hints and docstring)."""
    evaluate = Calculator(max_digits=max_digits, max_length=max_length)

    def _calculate(expression: str) -> str:
        """Evaluate an arithmetic expression: whole numbers exactly, decimals to 10 significant digits.

        Args:
            expression: The arithmetic expression, with numbers, + - * / // % ** and parentheses, e.g. "(12 + 3) * 47".
        """
        return evaluate(expression)

    return Tool.from_function(_calculate, name="calculator", timeout_s=timeout_s)


@hookimpl
def register_tools(register: Any) -> None:
    # Tool.from_function derives the schema through transformers (the "tools" extra).
    factory = Requires(calculator, module="transformers", install='pip install "palestra[tools]"')
    register("calculator", factory, options=CalculatorOptions, description="arithmetic on numbers (an AST walk)")
