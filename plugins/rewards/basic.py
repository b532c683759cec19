"""Built-in rewards for verifiable tasks: ``format`` (an answer tag or a pattern), ``correctness`` (the answer
against the metadata's ground truth) and ``length`` (closeness to a target length).

Each returns a float32 tensor ``[B]`` in [0, 1].
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

from palestra import hookimpl
from palestra.config import OptionError, check_options, option


def scores(values: list[float]) -> torch.Tensor:
    """A float32 tensor ``[B]``. torch is imported on first use, so loading this plugin does not pay for it."""
    import torch

    return torch.tensor(values, dtype=torch.float32)


_TAG_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]*$")


def tag_pattern(tag: str) -> re.Pattern[str]:
    return re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)


def extract_tag(text: str, tag: str) -> str | None:
    """The stripped content of the last ``<tag>...</tag>`` in ``text``, or None when there is none."""
    found = tag_pattern(tag).findall(text)
    return found[-1].strip() if found else None


def _check_tag(tag: str | None, key: str = "tag") -> None:
    if tag is not None and not _TAG_NAME.match(tag):
        raise OptionError(key, f"must be a tag name such as 'answer' (letters, digits, '_' or '-'), got {tag!r}")


# ---- format ------------------------------------------------------------------------------------------
@dataclass
class FormatOptions:
    tag: str = "answer"  # 1.0 when the completion holds exactly one <tag>...</tag> with something inside
    pattern: str | None = None  # instead: 1.0 when this regular expression matches (re.search, DOTALL)

    def __post_init__(self) -> None:
        _check_tag(self.tag)
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise OptionError("pattern", f"invalid regular expression: {e}") from None


class FormatReward:
    """1.0 if the completion is in the required format, else 0.0."""

    max_score = 1.0

    def __init__(self, **options: Any) -> None:
        self.options: FormatOptions = check_options(FormatOptions, options, where="format")
        o = self.options
        self._pattern = re.compile(o.pattern, re.DOTALL) if o.pattern is not None else None
        self._tag = tag_pattern(o.tag)

    def score(self, completion: str) -> float:
        if self._pattern is not None:
            return float(self._pattern.search(completion) is not None)
        found = self._tag.findall(completion)
        return float(len(found) == 1 and bool(found[0].strip()))

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        return scores([self.score(c) for c in completions])


# ---- correctness -------------------------------------------------------------------------------------
@dataclass
class CorrectnessOptions:
    tag: str | None = "answer"  # read the answer from the last <tag>...</tag>; null: the whole completion
    key: str = "answer"  # the metadata key holding the expected answer
    mode: Literal["auto", "numeric", "text"] = "auto"  # auto: numeric when the expected answer is a number
    tolerance: float = option(0.0, ge=0)  # numeric: |given - expected| <= tolerance counts as correct

    def __post_init__(self) -> None:
        _check_tag(self.tag)


# A plain number: digits with an optional sign, decimal part and exponent; thousands may be grouped by commas
# ("1,234,567") but only in threes, so "1,2" (a list, or a European decimal) is not read as twelve.
_NUMBER = re.compile(r"^[+-]?(\d{1,3}(,\d{3})+|\d+)?(\.\d*)?([eE][+-]?\d+)?$")
_FRACTION = re.compile(r"^([+-]?)(\d+)/(\d+)$")
_LATEX_FRACTION = re.compile(r"^([+-]?)\\[dt]?frac\{\s*(\d+)\s*\}\{\s*(\d+)\s*\}$")
_MAX_EXPONENT = 1000  # numbers beyond 1e+-1000 are not read as numbers (compared as text)
_WRAPPERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces and all; None when
    there is none or its braces do not close."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None


def clean_answer(text: str) -> str:
    """The answer with its decoration removed: the last ``\\boxed{...}`` if any, surrounding ``$...$`` (or
    ``\\(...\\)``, ``\\[...\\]``), a whole-answer ``\\text{...}``, a trailing period, outer whitespace."""
    text = text.strip()
    boxed = last_boxed(text)
    if boxed is not None:
        text = boxed.strip()
    changed = True
    while changed:  # "$\\boxed{5}$." takes several rounds
        changed = False
        for left, right in _WRAPPERS:
            if len(text) >= len(left) + len(right) and text.startswith(left) and text.endswith(right):
                text, changed = text[len(left) : len(text) - len(right)].strip(), True
        if text.startswith("\\text{") and text.endswith("}") and text.count("{") == 1:
            text, changed = text[len("\\text{") : -1].strip(), True
        if text.endswith(".") and len(text) > 1:
            text, changed = text[:-1].rstrip(), True
        inner = last_boxed(text)
        if inner is not None and text.startswith(("\\boxed{", "\\fbox{")) and text.endswith("}"):
            text, changed = inner.strip(), True
    return text


def parse_value(text: str) -> Fraction | None:
    """The exact value of a number written as ``1,234``, ``-0.50``, ``.5``, ``1e3``, ``3/4`` or ``\\frac{3}{4}``
    (after :func:`clean_answer`); None when the text is not one number. Exact, so ``0.1 + 0.2``-style float error
    never decides a match."""
    cleaned = clean_answer(text).replace(" ", "")
    for pattern in (_FRACTION, _LATEX_FRACTION):
        m = pattern.match(cleaned)
        if m:
            sign, num, den = m.groups()
            if int(den) == 0:
                return None
            value = Fraction(int(num), int(den))
            return -value if sign == "-" else value
    if not _NUMBER.match(cleaned) or not any(c.isdigit() for c in cleaned.split("e")[0].split("E")[0]):
        return None
    try:
        number = Decimal(cleaned.replace(",", ""))
    except InvalidOperation:
        return None
    if abs(number.adjusted()) > _MAX_EXPONENT:  # an exact 1e999999999 would take the memory of its digits
        return None
    return Fraction(number)


def parse_number(text: str) -> float | None:
    """``" 1,234. "`` -> 1234.0; None when the text is not a plain number (see :func:`parse_value`)."""
    value = parse_value(text)
    return None if value is None else float(value)


def normalise_text(text: str) -> str:
    """A text answer for comparison: decoration removed (:func:`clean_answer`), case folded, whitespace collapsed,
    trailing ``.`` and ``!`` dropped."""
    return " ".join(clean_answer(text).casefold().split()).rstrip(".!").rstrip()


def answers_match(
    given: str, expected: str, *, mode: Literal["auto", "numeric", "text"] = "auto", tolerance: float = 0.0
) -> bool:
    """Whether ``given`` is the ``expected`` answer: by value when the expected answer is a number (``auto``) or
    always (``numeric``), else as normalised text. Raises ValueError in ``numeric`` mode when ``expected`` is not a
    number (the data is wrong, not the completion)."""
    want = parse_value(expected)
    if mode == "numeric" and want is None:
        raise ValueError(f"mode is numeric but the expected answer {expected!r} is not a number")
    if mode == "numeric" or (mode == "auto" and want is not None):
        got = parse_value(given)
        assert want is not None
        if got is None:
            return False
        return got == want if tolerance == 0 else abs(float(got - want)) <= tolerance
    return normalise_text(given) == normalise_text(expected)


class CorrectnessReward:
    """1.0 if the completion's answer equals the expected answer in ``metadata[key]``, else 0.0 (see
    :func:`answers_match` for what counts as equal)."""

    max_score = 1.0

    def __init__(self, **options: Any) -> None:
        self.options: CorrectnessOptions = check_options(CorrectnessOptions, options, where="correctness")

    def score(self, completion: str, meta: Mapping[str, Any]) -> float:
        o = self.options
        if o.key not in meta:
            raise KeyError(f"metadata has no {o.key!r} (the expected answer); it has {sorted(meta)}")
        given = extract_tag(completion, o.tag) if o.tag is not None else completion.strip()
        if given is None:
            return 0.0
        return float(answers_match(given, str(meta[o.key]), mode=o.mode, tolerance=o.tolerance))

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        return scores([self.score(c, m) for c, m in zip(completions, metadata)])


# ---- length ------------------------------------------------------------------------------------------
@dataclass
class LengthOptions:
    target: int = option(32, ge=1)  # the length to aim for
    unit: Literal["words", "chars"] = "words"
    tolerance: int = option(0, ge=0)  # lengths within target +- tolerance score 1.0


class LengthReward:
    """1.0 within ``target +- tolerance``, falling linearly to 0.0 at ``tolerance + target`` away from it."""

    max_score = 1.0

    def __init__(self, **options: Any) -> None:
        self.options: LengthOptions = check_options(LengthOptions, options, where="length")

    def length(self, completion: str) -> int:
        return len(completion.split()) if self.options.unit == "words" else len(completion)

    def score(self, completion: str) -> float:
        o = self.options
        excess = max(0, abs(self.length(completion) - o.target) - o.tolerance)
        return max(0.0, 1.0 - excess / o.target)

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        return scores([self.score(c) for c in completions])


@hookimpl
def register_rewards(register: Any) -> None:
    register(
        "format",
        FormatReward,
        options=FormatOptions,
        description="1 if the completion has exactly one <answer> tag (or matches a pattern)",
    )
    register(
        "correctness",
        CorrectnessReward,
        options=CorrectnessOptions,
        description="1 if the tagged answer equals metadata['answer'] (numeric or text)",
    )
    register(
        "length", LengthReward, options=LengthOptions, description="closeness of the completion's length to a target"
    )
