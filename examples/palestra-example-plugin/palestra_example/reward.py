"""A keyword-coverage reward: the fraction of the required keywords that a completion contains."""

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class KeywordOptions:
    """Options of the ``keyword_coverage`` reward (a config sets them under ``reward.options``)."""

    keywords: list[str] = field(default_factory=list)
    """Keywords every completion should contain. When empty, each row's keywords are read from its
    episode metadata under ``metadata_key`` (the ``word_usage`` environment puts them there)."""
    metadata_key: str = "keywords"
    case_sensitive: bool = False
    whole_words: bool = True
    """Match whole words only, so "cat" is not found in "concatenate"."""

    def __post_init__(self) -> None:
        for i, word in enumerate(self.keywords):
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"keyword_coverage: keywords[{i}] must be a non-empty string, got {word!r}")


class KeywordCoverage:
    """Scores each completion with the fraction (0 to 1) of its keywords that it contains."""

    def __init__(self, **options: Any) -> None:
        self.options = KeywordOptions(**options)

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        if not (len(prompts) == len(completions) == len(metadata)):
            raise ValueError(
                f"keyword_coverage: prompts, completions and metadata must have the same length, got "
                f"{len(prompts)}, {len(completions)} and {len(metadata)}"
            )
        scores = [self._score(row, text, meta) for row, (text, meta) in enumerate(zip(completions, metadata))]
        return torch.tensor(scores, dtype=torch.float32)

    def _score(self, row: int, completion: str, metadata: Mapping[str, Any]) -> float:
        keywords = self.options.keywords or metadata.get(self.options.metadata_key)
        if not keywords:
            raise ValueError(
                f"keyword_coverage: row {row} has no keywords: set reward.options.keywords or put a list under "
                f"metadata[{self.options.metadata_key!r}]"
            )
        return sum(self._contains(completion, word) for word in keywords) / len(keywords)

    def _contains(self, text: str, word: str) -> bool:
        flags = 0 if self.options.case_sensitive else re.IGNORECASE
        pattern = rf"\b{re.escape(word)}\b" if self.options.whole_words else re.escape(word)
        return re.search(pattern, text, flags) is not None
