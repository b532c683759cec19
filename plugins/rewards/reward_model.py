"""``reward_model``: a trained reward model, a transformers sequence classifier
(``AutoModelForSequenceClassification``) read from a local folder, scores each (prompt, completion) pair.

The pair is rendered with the tokenizer's chat template when it has one (a user message, the prompt, and the
assistant's reply, the completion; ``chat_template: off`` turns it off), otherwise as the tokenizer's own text pair
(``tokenizer(prompt, completion)``: ``[CLS] prompt [SEP] completion [SEP]`` for a BERT-style model). Rows run in
batches of ``batch_size``, right-padded; ``max_length`` keeps each row's last tokens (the end of the completion).

The score: a one-logit head gives its logit (``output: logit``) or its sigmoid (``output: probability``); a head of
two or more classes gives the logit or the softmax probability of class ``positive_label`` (default 1 for two
classes; name it for more). Then ``(score - center) / scale``: a fixed normalisation (for example the mean and
spread of the model's scores on reference replies), so a row's score never depends on the rest of its batch.

Loading goes through the hf policy's checks (a local folder, ``package:NAME``, nothing downloaded; one line naming
this reward's option on any problem). A folder whose head is not in the checkpoint (a causal LM's folder, which
transformers would give a randomly initialised head) is refused. It runs on ``device`` with ``threads`` threads,
like ``judge``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from palestra import hookimpl
from palestra.config import ConfigError, OptionError, check_options, option
from palestra.plugins.rewards._model_rewards import (
    check_device_option,
    in_batches,
    named_as,
    options_path,
    pick_device,
    torch_threads,
)
from palestra.registry import Requires

if TYPE_CHECKING:
    import torch


CLASSIFIER = "a transformers sequence classifier"


@dataclass
class RewardModelOptions:
    path: str = option(path="cwd")  # a local folder holding a sequence classifier, or package:NAME
    tokenizer_path: str | None = option(None, path="cwd")  # a folder holding the tokenizer; null: the model's folder
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    chat_template: Literal["auto", "on", "off"] = "auto"  # auto: the tokenizer's chat template when it has one
    trust_remote_code: bool = option(False, runs_code=True)  # run modelling code shipped inside the folder
    output: Literal["logit", "probability"] = "logit"  # the positive class's logit, or its probability
    positive_label: int | None = option(None, ge=0)  # the class scored; null: the only logit, or class 1 of two
    center: float = 0.0  # score = (raw - center) / scale
    scale: float = option(1.0, gt=0)
    max_length: int | None = option(None, ge=1)  # keep each row's last max_length tokens; null: whole rows
    batch_size: int = option(8, ge=1)  # rows per forward
    device: str = "auto"  # auto (the first GPU, else the CPU), cpu, cuda, cuda:N or mps
    threads: int | None = option(None, ge=1)  # torch intra-op threads for the reward's call; null: the trainer's

    def __post_init__(self) -> None:
        from palestra.plugins.policies.hf import HFOptions

        if not self.path.strip():
            raise OptionError("path", f"must name a local folder holding {CLASSIFIER}, got ''")
        HFOptions(path=self.path, tokenizer_path=self.tokenizer_path)  # the same checks as the policy's
        if why := check_device_option(self.device):
            raise OptionError("device", why)


class RewardModel:
    """A sequence-classification reward model (see the module docstring and :class:`RewardModelOptions`)."""

    def __init__(self, **options: Any) -> None:
        self.where = options_path()
        self.options: RewardModelOptions = check_options(RewardModelOptions, options, where=self.where)
        o = self.options
        self.device = pick_device(o.device, self.where)
        with named_as(self.where, model=CLASSIFIER):
            self.model, self.tokenizer, self.source = _load(o, self.where)
        self.model.to(self.device)
        self.use_chat = _chat_choice(o.chat_template, self.tokenizer, self.where)
        self.model_pad = self.model.config.get_text_config().pad_token_id  # None: batches pad with a free id
        self.classes = int(self.model.config.num_labels)
        self.positive = _positive_class(o.positive_label, self.classes, self.model.config, self.where)

    @property
    def max_score(self) -> float | None:
        """1 for a probability (before the normalisation); a logit has no bound."""
        o = self.options
        return (1.0 - o.center) / o.scale if o.output == "probability" else None

    def __deepcopy__(self, memo: dict[int, Any]) -> RewardModel:
        """A copy that shares the model (its weights never change; held-out scoring runs on a copy)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        memo[id(self)] = twin
        return twin

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        import torch

        rows = [self.encode(p, c) for p, c in zip(prompts, completions)]
        with torch_threads(self.options.threads):
            raw = in_batches(rows, self.options.batch_size, self._forward)
        scores = torch.tensor(raw, dtype=torch.float32)
        return (scores - self.options.center) / self.options.scale

    def encode(self, prompt: str, completion: str) -> dict[str, list[int]]:
        """One row's model inputs (``input_ids`` and, for a model that has them, ``token_type_ids``), unpadded."""
        tok = self.tokenizer
        if self.use_chat:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            text = tok.apply_chat_template(messages, tokenize=False)
            enc = tok(text, add_special_tokens=False)
        else:
            enc = tok(prompt, completion)
        row = {k: list(v) for k, v in enc.items() if k != "attention_mask"}
        limit = self.options.max_length
        if limit is not None and len(row["input_ids"]) > limit:
            row = {k: v[-limit:] for k, v in row.items()}
        return row

    def _forward(self, rows: list[dict[str, list[int]]]) -> list[float]:
        import torch

        pad = self._pad_id(rows)
        width = max(len(r["input_ids"]) for r in rows)
        batch = {
            k: torch.tensor([r[k] + [pad if k == "input_ids" else 0] * (width - len(r[k])) for r in rows])
            for k in rows[0]
        }
        lengths = [len(r["input_ids"]) for r in rows]
        batch["attention_mask"] = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
        with torch.no_grad():
            logits = self.model(**{k: v.to(self.device) for k, v in batch.items()}).logits.float()
        return self._scores(logits).tolist()

    def _pad_id(self, rows: list[dict[str, list[int]]]) -> int:
        """The id rows are padded with, which the head's pooling skips: the model's pad token, else one id that no row
        of this batch contains (transformers reads the rightmost token that is not the pad id)."""
        if self.model_pad is not None:
            return int(self.model_pad)
        used = {i for r in rows for i in r["input_ids"]}
        free = next(i for i in range(self.model.get_input_embeddings().num_embeddings - 1, -1, -1) if i not in used)
        self.model.config.get_text_config().pad_token_id = free  # what this batch's forward reads, set per batch
        return free

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        import torch

        if self.classes == 1:
            raw = logits[:, 0]
            return torch.sigmoid(raw) if self.options.output == "probability" else raw
        if self.options.output == "probability":
            return torch.softmax(logits, dim=-1)[:, self.positive]
        return logits[:, self.positive]


def _load(o: RewardModelOptions, where: str) -> tuple[Any, Any, str]:
    """``(model, transformers tokenizer, source)`` through the hf policy's checks; the model frozen, in eval mode."""
    import transformers

    from palestra.models.progress_bars import transformers_bars_off
    from palestra.plugins.policies._hf_model import _load_tokenizer, _locate_sources, _read_config
    from palestra.plugins.policies.hf import HFOptions, _resolve_dtype

    src = _locate_sources(HFOptions(path=o.path, tokenizer_path=o.tokenizer_path))
    common = {"local_files_only": True, "trust_remote_code": o.trust_remote_code}
    config = _read_config(transformers, src, common)
    remote = "AutoModelForSequenceClassification" in (getattr(config, "auto_map", None) or {})
    if type(config) not in transformers.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING and not remote:
        raise ConfigError(
            f"{where}.path: {src.source!r} holds a {config.model_type!r} model, which transformers has no "
            "sequence-classification class for"
        )
    dtype = _resolve_dtype(o.dtype, config)
    with transformers_bars_off(unless_terminal=True):
        tokenizer = _load_tokenizer(transformers, src, config, common).hf
        model, info = _classifier(transformers, src.model_dir, dtype, common, where)
    if info.get("missing_keys"):
        missing = ", ".join(sorted(info["missing_keys"])[:4])
        archs = ", ".join(getattr(config, "architectures", None) or []) or "no architectures listed"
        raise ConfigError(
            f"{where}.path: {src.source!r} ({archs}) has no trained classification head (missing: {missing}); "
            "name a folder saved from a sequence classifier"
        )
    return model.eval().requires_grad_(False), tokenizer, src.source


def _classifier(transformers: Any, folder: str, dtype: Any, common: dict[str, Any], where: str) -> tuple[Any, Any]:
    from palestra.plugins.policies.hf import _dtype_kwarg, _first_line

    try:
        return transformers.AutoModelForSequenceClassification.from_pretrained(
            folder, output_loading_info=True, **{_dtype_kwarg(): dtype}, **common
        )
    except Exception as e:  # noqa: BLE001  (a folder can fail to load in many ways; all are config errors)
        raise ConfigError(
            f"{where}.path: cannot load a sequence classifier from {folder!r}: {_first_line(e)}"
        ) from None


def _chat_choice(choice: str, tokenizer: Any, where: str) -> bool:
    has = bool(getattr(tokenizer, "chat_template", None))
    if choice == "on" and not has:
        raise ConfigError(f"{where}.chat_template: is 'on' but the tokenizer has no chat template; use 'auto' or 'off'")
    return has and choice != "off"


def _positive_class(chosen: int | None, classes: int, config: Any, where: str) -> int:
    labels = getattr(config, "id2label", None) or {}
    named = ", ".join(f"{i}: {labels.get(i, i)}" for i in range(classes))
    if chosen is None:
        if classes <= 2:
            return classes - 1  # the only logit, or class 1 of two (transformers' LABEL_1, "positive", "chosen")
        raise ConfigError(f"{where}.positive_label: the model has {classes} classes ({named}); name the one to score")
    if chosen >= classes:
        raise ConfigError(f"{where}.positive_label: is {chosen}, but the model has {classes} class(es) ({named})")
    return chosen


@hookimpl
def register_rewards(register: Any) -> None:
    register(
        "reward_model",
        Requires(RewardModel, module="transformers", install='pip install "palestra[hf]"'),
        options=RewardModelOptions,
        description="a trained reward model: a local transformers sequence classifier scores (prompt, completion)",
    )
