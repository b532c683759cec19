"""A character-level tokenizer with a handful of multi-character "atoms": :class:`CharTokenizer`.

The built-in task must be learnable by RL from a random init in minutes on a CPU, so the vocabulary has
to be tiny (~25 tokens): then a random policy emits ``<answer>12</answer>`` often enough to get a first
reward. Tags such as ``<answer>`` are single tokens (atoms) for the same reason.

Vocabulary, in order: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3, then the atoms (matched
greedily, longest first), then each character of the alphabet. The mapping depends on the constructor
arguments only, so it is deterministic and round-trips through :meth:`to_dict` / :meth:`from_dict`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
UNK_TEXT = "\ufffd"  # what decode() shows for <unk>: the Unicode replacement character

Unknown = Literal["unk", "drop"]


def check_vocabulary(alphabet: str, atoms: Sequence[str], unknown: str) -> tuple[str, str] | None:
    """``(argument, problem)`` for the first thing wrong with these tokenizer arguments, or None when they are fine.

    Shared by :class:`CharTokenizer` (which raises ValueError) and the tiny policy's options (OptionError).
    """
    if not alphabet:
        return "alphabet", "must hold at least one character"
    seen: set[str] = set()
    for c in alphabet:
        if c in seen:
            return "alphabet", f"has the character {c!r} twice"
        seen.add(c)
    atom_set: set[str] = set()
    for i, atom in enumerate(atoms):
        if not isinstance(atom, str) or len(atom) < 2:
            return (
                f"atoms[{i}]",
                f"must be a string of two or more characters (single characters belong in the alphabet), got {atom!r}",
            )
        if atom in atom_set:
            return f"atoms[{i}]", f"{atom!r} is listed twice"
        if atom in SPECIAL_TOKENS:
            return f"atoms[{i}]", f"{atom!r} is a special token name; pick another spelling"
        atom_set.add(atom)
    if unknown not in ("unk", "drop"):
        return "unknown", f"must be 'unk' or 'drop', got {unknown!r}"
    return None


class CharTokenizer:
    """Characters (and atoms) to ids and back; implements :class:`palestra.models.policy.Tokenizer`.

    ``encode`` adds no special tokens; characters outside the alphabet become ``<unk>`` (or are dropped when
    ``unknown="drop"``). ``decode`` skips ``<pad>``, ``<bos>`` and ``<eos>`` and renders ``<unk>`` as U+FFFD.
    """

    pad_token_id = 0
    bos_token_id: int | None = 1
    eos_token_id = 2
    unk_token_id = 3

    def __init__(self, alphabet: str, atoms: Sequence[str] = (), unknown: Unknown = "unk") -> None:
        problem = check_vocabulary(alphabet, atoms, unknown)
        if problem is not None:
            raise ValueError(f"CharTokenizer {problem[0]}: {problem[1]}")
        self.alphabet = alphabet
        self.atoms: tuple[str, ...] = tuple(atoms)
        self.unknown: Unknown = unknown
        self.vocab: tuple[str, ...] = (*SPECIAL_TOKENS, *self.atoms, *alphabet)
        first_char = len(SPECIAL_TOKENS) + len(self.atoms)
        self._char_ids: dict[str, int] = {c: first_char + i for i, c in enumerate(alphabet)}
        # Atoms grouped by their first character, longest first: encode() tries them before the single character.
        by_first: dict[str, list[tuple[str, int]]] = {}
        for i, atom in enumerate(self.atoms):
            by_first.setdefault(atom[0], []).append((atom, len(SPECIAL_TOKENS) + i))
        self._atoms_by_first = {c: sorted(v, key=lambda a: -len(a[0])) for c, v in by_first.items()}
        # decode() table: what each id renders as ("" for pad/bos/eos).
        self._pieces: list[str] = ["", "", "", UNK_TEXT, *self.atoms, *alphabet]

    def __len__(self) -> int:
        return len(self.vocab)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        i, n = 0, len(text)
        atoms_by_first, char_ids = self._atoms_by_first, self._char_ids
        drop = self.unknown == "drop"
        while i < n:
            c = text[i]
            for atom, atom_id in atoms_by_first.get(c, ()):
                if text.startswith(atom, i):
                    ids.append(atom_id)
                    i += len(atom)
                    break
            else:
                token = char_ids.get(c)
                if token is not None:
                    ids.append(token)
                elif not drop:
                    ids.append(self.unk_token_id)
                i += 1
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        pieces = self._pieces
        try:
            if len(ids) and min(ids) < 0:  # a negative index would silently wrap around
                raise IndexError
            return "".join([pieces[i] for i in ids])
        except (IndexError, TypeError):
            bad = next((i for i in ids if not isinstance(i, int) or not 0 <= i < len(pieces)), ids)
            raise ValueError(
                f"CharTokenizer.decode: id {bad!r} is not in the vocabulary of {len(pieces)} tokens"
            ) from None

    def token_to_id(self, token: str) -> int:
        """The id of a vocabulary entry (a special token, an atom or one character)."""
        try:
            return self.vocab.index(token)
        except ValueError:
            raise KeyError(f"CharTokenizer: {token!r} is not in the vocabulary") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain data that :meth:`from_dict` rebuilds the same tokenizer from."""
        return {"alphabet": self.alphabet, "atoms": list(self.atoms), "unknown": self.unknown}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CharTokenizer:
        return cls(alphabet=data["alphabet"], atoms=list(data.get("atoms", ())), unknown=data.get("unknown", "unk"))

    def to_transformers(self, *, model_max_length: int) -> Any:
        """The same tokenizer as a transformers ``PreTrainedTokenizerFast`` (built on the ``tokenizers`` library), so
        that an exported tiny policy loads with ``AutoTokenizer.from_pretrained`` and encodes text to the same ids.

        The pieces, each chosen to reproduce :meth:`encode`: a word-level vocabulary holding every token at the
        same id; the atoms as added tokens, which ``tokenizers`` matches before anything else, leftmost and longest
        first (what :meth:`encode` does at each position); a pre-tokenizer that isolates every code point, so each
        character is looked up alone; unknown characters become ``<unk>``, or (``unknown="drop"``) are deleted by a
        normalizer first. Encoding with special tokens puts ``<bos>`` in front, as the policy does with prompts.

        Two differences remain, both inherent to transformers tokenizers: text that literally contains a special
        token's name (``<bos>``) encodes to that token, and ``decode(..., skip_special_tokens=True)`` drops
        ``<unk>`` where :meth:`decode` shows U+FFFD.
        """
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        backend = Tokenizer(models.WordLevel({token: i for i, token in enumerate(self.vocab)}, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        if self.unknown == "drop":
            kept = "".join(f"\\x{{{ord(c):x}}}" for c in self.alphabet)  # code points: no character needs escaping
            backend.normalizer = normalizers.Replace(Regex(f"[^{kept}]"), "")
        backend.decoder = decoders.Fuse()  # characters join without separators
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS])
        backend.add_tokens([AddedToken(a, normalized=False, special=False) for a in self.atoms])
        bos_id = self.bos_token_id
        assert bos_id is not None  # typed optional for the Tokenizer protocol; a CharTokenizer always has <bos>
        bos = SPECIAL_TOKENS[bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
        pad, eos, unk = (SPECIAL_TOKENS[i] for i in (self.pad_token_id, self.eos_token_id, self.unk_token_id))
        return PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token=bos,
            eos_token=eos,
            pad_token=pad,
            unk_token=unk,
            model_max_length=model_max_length,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable-looking value object: equality only

    def __repr__(self) -> str:
        return (
            f"CharTokenizer(vocab_size={len(self)}, atoms={list(self.atoms)!r}, alphabet={self.alphabet!r},"
            f" unknown={self.unknown!r})"
        )


__all__ = ["SPECIAL_TOKENS", "UNK_TEXT", "CharTokenizer", "check_vocabulary"]
