"""Built-in rewards for verifiable tasks: ``format`` (an answer tag or a pattern), ``correctness`` (the answer
against the metadata's ground truth) and ``length`` (closeness to a target length).

Each returns a float32 tensor ``[B]`` in [0, 1].
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> torch.Tensor:
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


_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def parse_number(text: str) -> float | None:
    """``" 1,234. "`` -> 1234.0; None when the text is not a plain number."""
    cleaned = text.strip().replace(",", "").replace(" ", "").rstrip(".")
    return float(cleaned) if _NUMBER.match(cleaned) else None


def _normalise_text(text: str) -> str:
    return " ".join(text.casefold().split()).rstrip(".!")


class CorrectnessReward:
    """1.0 if the completion's answer equals the expected answer in ``metadata[key]``, else 0.0."""

    max_score = 1.0

    def __init__(self, **options: Any) -> None:
        self.options: CorrectnessOptions = check_options(CorrectnessOptions, options, where="correctness")

    def score(self, completion: str, meta: Mapping[str, Any]) -> float:
        o = self.options
        if o.key not in meta:
            raise KeyError(f"metadata has no {o.key!r} (the expected answer); it has {sorted(meta)}")
        expected = str(meta[o.key])
        given = extract_tag(completion, o.tag) if o.tag is not None else completion.strip()
        if given is None:
            return 0.0
        want_number = parse_number(expected)
        if o.mode == "numeric" and want_number is None:
            raise ValueError(f"mode is numeric but the expected answer {expected!r} is not a number")
        if o.mode == "numeric" or (o.mode == "auto" and want_number is not None):
            got = parse_number(given)
            assert want_number is not None
            return float(got is not None and abs(got - want_number) <= o.tolerance)
        return float(_normalise_text(given) == _normalise_text(expected))

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> torch.Tensor:
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

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        return scores([self.score(c) for c in completions])


@hookimpl
def register_rewards(register: Any) -> None:
    register("format", FormatReward, options=FormatOptions, description="1 if the completion has exactly one <answer> tag (or matches a pattern)")
    register("correctness", CorrectnessReward, options=CorrectnessOptions, description="1 if the tagged answer equals metadata['answer'] (numeric or text)")
    register("length", LengthReward, options=LengthOptions, description="closeness of the completion's length to a target")
