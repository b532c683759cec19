"""The ``hf`` policy's model classes: :class:`HFPolicy`, :class:`LoRAHFPolicy` and the LoRA KL reference.

Kept apart from :mod:`palestra.plugins.policies.hf` (the options, the loading checks and the registration) because
defining them imports torch: ``hf.py`` loads this module on first use, so that listing plugins stays fast. Their
``__module__`` is ``palestra.plugins.policies.hf``, where users (and pickle) find them.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import mmap
import struct
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from palestra.config import ConfigError, check_options
from palestra.models.policy import CausalLMPolicy
from palestra.models.progress_bars import transformers_bars_off
from palestra.plugins.policies._chat import ChatRenderer
from palestra.plugins.policies.hf import (
    WHERE,
    HFOptions,
    HFTokenizer,
    _check_folder,
    _check_targets,
    _check_tokenizer_fits,
    _dtype_kwarg,
    _first_line,
    _locate_gguf,
    _resolve_dtype,
    _resolve_package,
    _vocab_rows,
)
from palestra.types import Observation

__all__ = ["BaseReference", "HFPolicy", "LoRAHFPolicy"]


# ---- loading, step by step (each raises a one-line ConfigError naming the option) -----------------------
@dataclass(frozen=True)
class _Sources:
    """Where the model and the tokenizer are read from, and the option each error names."""

    model_key: str  # "path", or "gguf_file" when the weights come from a GGUF file
    model_dir: str  # the folder transformers reads
    source: str  # what errors name: the folder, or the GGUF file in it
    from_file: dict[str, str] = field(default_factory=dict)  # {"gguf_file": name} for a GGUF model
    tok_key: str = "path"
    tok_dir: str = ""
    tok_file: dict[str, str] = field(default_factory=dict)

    @property
    def paths(self) -> dict[str, str]:
        """The keyword arguments of :func:`_check_tokenizer_fits` that name the folders."""
        return {"model_dir": self.source, "tok_dir": self.tok_dir, "tok_key": self.tok_key}


def _locate_sources(o: HFOptions) -> _Sources:
    """The model's folder (or GGUF file) and the tokenizer's, checked to exist before anything is read."""
    model_key = "gguf_file" if o.gguf_file is not None else "path"
    path = _resolve_package("path", o.path)
    if o.gguf_file is None:
        model_dir = str(_check_folder("path", path, what="a transformers causal LM", needs="config.json"))
        source, from_file = model_dir, {}
    else:
        model_dir, name = _locate_gguf(_check_folder("path", path, what="a GGUF file"), o.gguf_file)
        source, from_file = str(Path(model_dir) / name), {"gguf_file": name}
        _check_gguf_whole(Path(source))
    tok_key, tok_dir, tok_file = model_key, model_dir, from_file
    if o.tokenizer_path is not None:
        tok_path = _resolve_package("tokenizer_path", o.tokenizer_path)
        tok_key, tok_file = "tokenizer_path", {}
        tok_dir = str(_check_folder("tokenizer_path", tok_path, what="a transformers tokenizer"))
    return _Sources(model_key, model_dir, source, from_file, tok_key, tok_dir, tok_file)


def _read_config(transformers: Any, src: _Sources, common: dict[str, Any]) -> Any:
    try:
        return transformers.AutoConfig.from_pretrained(src.model_dir, **src.from_file, **common)
    except Exception as e:  # noqa: BLE001  (unknown model type, untrusted remote code, bad json, ...)
        raise ConfigError(
            f"{WHERE}.{src.model_key}: cannot read the model config in {src.source!r}: {_first_line(e)}"
        ) from None


def _load_tokenizer(transformers: Any, src: _Sources, config: Any, common: dict[str, Any]) -> HFTokenizer:
    """The tokenizer, adapted; EOS falls back to the model config's (its first, when it lists several)."""
    try:
        hf_tok = transformers.AutoTokenizer.from_pretrained(src.tok_dir, **src.tok_file, **common)
    except Exception as e:  # noqa: BLE001  (a folder can fail to load in many ways; all are config errors)
        what = src.source if src.tok_file else src.tok_dir
        if not src.tok_file:
            _check_tokenizer_files(src)
        raise ConfigError(f"{WHERE}.{src.tok_key}: cannot load a tokenizer from {what!r}: {_first_line(e)}") from None
    eos_fallback = getattr(config, "eos_token_id", None)
    if isinstance(eos_fallback, (list, tuple)):
        eos_fallback = eos_fallback[0] if eos_fallback else None
    try:
        return HFTokenizer(hf_tok, eos_token_id=eos_fallback)
    except ValueError as e:
        raise ConfigError(f"{WHERE}.{src.tok_key}: the tokenizer at {src.tok_dir!r}: {e}") from None


# The files transformers builds a tokenizer from: a folder needs every file of one of these sets.
TOKENIZER_FILES = (
    ("tokenizer.json",),
    ("tokenizer.model",),
    ("spiece.model",),
    ("vocab.json", "merges.txt"),
    ("vocab.txt",),
)


def _check_tokenizer_files(src: _Sources) -> None:
    """A folder without any tokenizer files is said as that (transformers' own error is a paragraph about backends)."""
    folder = Path(src.tok_dir)
    if any(all((folder / f).is_file() for f in files) for files in TOKENIZER_FILES):
        return
    wanted = ", ".join(" + ".join(files) for files in TOKENIZER_FILES)
    fix = "copy them next to the model" if src.tok_key == "path" else "name a folder that holds them"
    also = f", or set {WHERE}.tokenizer_path to a folder holding them" if src.tok_key == "path" else ""
    raise ConfigError(
        f"{WHERE}.{src.tok_key}: {src.tok_dir!r} holds no tokenizer files (none of {wanted}); {fix}{also}"
    )


# ---- a GGUF file cut short (an interrupted download or copy) ---------------------------------------------
# GGUF value types (the format's own numbering) -> size in bytes; 8 (a string) and 9 (an array) are read apart
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class _GGUFTruncated(Exception):
    """The file ended inside its header."""


class _GGUFHeader:
    """Reads just enough of a little-endian GGUF (v2, v3) header to know how many bytes the whole file needs."""

    def __init__(self, data: Any) -> None:
        self.data, self.pos = data, 4  # after the magic

    def take(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self.data, self.pos) if self._fits(struct.calcsize(fmt)) else ()
        self.pos += struct.calcsize(fmt)
        return values

    def skip(self, size: int) -> None:
        self._fits(size)
        self.pos += size

    def _fits(self, size: int) -> bool:
        if self.pos + size > len(self.data):
            raise _GGUFTruncated
        return True

    def string(self) -> bytes:
        (size,) = self.take("<Q")
        self._fits(size)
        self.pos += size
        return bytes(self.data[self.pos - size : self.pos])

    def skip_value(self, kind: int) -> None:
        if kind == 8:
            self.string()
        elif kind == 9:
            item, count = self.take("<IQ")
            if item in _GGUF_SCALARS:
                self.skip(count * _GGUF_SCALARS[item])
            else:
                for _ in range(count):
                    self.skip_value(item)
        elif kind in _GGUF_SCALARS:
            self.skip(_GGUF_SCALARS[kind])
        else:
            raise ValueError(f"unknown GGUF value type {kind}")

    def needed_size(self, block_sizes: Mapping[int, tuple[int, int]]) -> int | None:
        """The bytes the header and every tensor it lists take; None when this reader does not know the layout."""
        version, tensors, keys = self.take("<IQQ")
        if version not in (2, 3):
            return None
        alignment = 32  # the format's default, unless general.alignment says otherwise
        for _ in range(keys):
            key, (kind,) = self.string(), self.take("<I")
            if key == b"general.alignment" and kind == 4:
                (alignment,) = self.take("<I")
            else:
                self.skip_value(kind)
        end = 0
        for _ in range(tensors):
            self.string()
            (dims,) = self.take("<I")
            shape = self.take(f"<{dims}Q")
            kind, offset = self.take("<IQ")
            if kind not in block_sizes:
                return None
            block, block_bytes = block_sizes[kind]
            end = max(end, offset + _count(shape) // block * block_bytes)
        return -(-self.pos // alignment) * alignment + end


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_gguf_whole(file: Path) -> None:
    """A GGUF file shorter than its own header says is named as truncated (transformers would report a numpy reshape
    of the first tensor it cannot fill)."""
    try:
        import gguf
    except ImportError:  # build_hf_policy asked for it already; without it transformers says so itself
        return
    sizes = {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}
    with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        have = len(data)
        try:
            need = _GGUFHeader(data).needed_size(sizes)
        except _GGUFTruncated:
            raise ConfigError(
                f"{WHERE}.gguf_file: {str(file)!r} is truncated: it is {have} bytes and ends inside its own header; "
                "download or copy it again"
            ) from None
        except (ValueError, struct.error, OverflowError):
            return  # a header this reader does not follow: transformers' own reading decides
    if need is not None and have < need:
        raise ConfigError(
            f"{WHERE}.gguf_file: {str(file)!r} is truncated: it is {have} bytes, but its header lists tensors up to "
            f"byte {need}; download or copy it again"
        )


def _load_model(
    transformers: Any, src: _Sources, attn_implementation: str, dtype: torch.dtype, common: dict[str, Any]
) -> Any:
    load = dict(src.from_file)
    if src.from_file:
        # Dense weights (the packed GGUF layers some devices would get are not trainable), and a model no
        # longer marked as quantised: with the mark, transformers refuses to save it and TRL / transformers'
        # Trainer refuse to train it as "purely quantized".
        load["quantization_config"] = transformers.GgufConfig(dequantize=True)
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(
            src.model_dir, attn_implementation=attn_implementation, **{_dtype_kwarg(): dtype}, **load, **common
        )
    except Exception as e:  # noqa: BLE001  (a folder can fail to load in many ways; all are config errors)
        key = "attn_implementation" if "attn" in str(e).lower() else src.model_key
        raise ConfigError(f"{WHERE}.{key}: cannot load the model from {src.source!r}: {_first_line(e)}") from None


# ---- the policies -----------------------------------------------------------------------------------------
class HFPolicy(CausalLMPolicy):
    """A HuggingFace causal LM as a Palestra policy (see the module docstring and :class:`HFOptions`).

    The wrapped model is ``self.model`` (a ``PreTrainedModel``; :class:`LoRAHFPolicy` wraps it in peft's
    ``PeftModel``, and :attr:`hf_model` is the transformers model either way); the adapted tokenizer is
    ``self.tokenizer`` (its transformers tokenizer is ``self.tokenizer.hf``). Built in training mode,
    like any fresh ``torch.nn.Module``; the trainer switches modes.
    """

    __module__ = "palestra.plugins.policies.hf"  # pickle and reprs find it there (hf.py loads this module on first use)

    tokenizer: HFTokenizer  # the base's Tokenizer, and more (the chat template, the transformers tokenizer)

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options: HFOptions = check_options(HFOptions, options, where=WHERE)
        o = self.options
        src = _locate_sources(o)

        import transformers

        common = {"local_files_only": True, "trust_remote_code": o.trust_remote_code}
        with transformers_bars_off(unless_terminal=True):  # reading a GGUF's config converts its tensors, with a bar
            config = _read_config(transformers, src, common)
        self._check_causal(config, src.source, src.model_key)
        dtype = _resolve_dtype(o.dtype, config)
        # What an export writes by default: the dtype the weights came in. A GGUF holds 16-bit or quantised values,
        # so bf16 keeps them (float32 would quadruple a 100 MB file into 540 MB of the same numbers, near enough).
        self.source_dtype = torch.bfloat16 if src.from_file and o.dtype == "auto" else dtype
        with transformers_bars_off(unless_terminal=True):
            self.tokenizer = _load_tokenizer(transformers, src, config, common)
        rows = _vocab_rows(config)
        if rows is not None:  # before loading any weights: a mismatch should not cost a 10 GB read
            _check_tokenizer_fits(self.tokenizer, rows, **src.paths)
        self._use_chat = self._chat_choice(o.chat_template, src.tok_key, src.tok_dir)
        with transformers_bars_off(unless_terminal=True):  # a log file gets no redrawn bars
            model = _load_model(transformers, src, o.attn_implementation, dtype, common)
        _check_tokenizer_fits(self.tokenizer, model.get_input_embeddings().num_embeddings, **src.paths)
        if o.gradient_checkpointing:
            self._enable_checkpointing(model, src.source)
        model = self._adapt(model, src.source)
        model.train()  # like any fresh module; from_pretrained hands back eval mode
        self.model = model
        self._decoder = self.hf_model.get_decoder()
        params = inspect.signature(self._decoder.forward).parameters
        # transformers 5 renamed the cache argument ``past_key_values`` -> ``cache``
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._attn_now = o.attn_implementation  # the implementation the model is set to

    def _adapt(self, model: Any, source: str) -> Any:
        """The module :attr:`model` holds: the transformers model itself (every weight trains)."""
        if self.options.lora is not None:
            raise TypeError(
                "HFPolicy trains every weight; with options.lora build the policy with "
                "build_hf_policy(...) (or LoRAHFPolicy), which adds the adapters"
            )
        return model

    @property
    def hf_model(self) -> Any:
        """The transformers ``PreTrainedModel`` (for LoRA, the one inside peft's wrapper, adapters injected)."""
        return self.model

    # -- construction checks --
    @staticmethod
    def _check_causal(config: Any, model_dir: str, key: str) -> None:
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

        remote = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
        if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not remote:
            archs = ", ".join(getattr(config, "architectures", None) or []) or "no architectures listed"
            raise ConfigError(
                f"{WHERE}.{key}: {model_dir!r} holds a {config.model_type!r} model ({archs}), which is not a "
                "causal language model (AutoModelForCausalLM cannot load it)"
            )

    def _chat_choice(self, choice: str, tok_key: str, tok_dir: str) -> bool:
        has = self.tokenizer.chat_template is not None
        if choice == "on" and not has:
            raise ConfigError(
                f"{WHERE}.chat_template: is 'on' but the tokenizer at {tok_dir!r} ({WHERE}.{tok_key}) has no "
                "chat template; use 'auto' or 'off'"
            )
        return has and choice != "off"

    @staticmethod
    def _enable_checkpointing(model: Any, model_dir: str) -> None:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(
                f"{WHERE}.gradient_checkpointing: the model at {model_dir!r} ({type(model).__name__}) does not "
                "support it; set it to false"
            )
        # non-reentrant: works when the inputs need no grad and with torch.compile
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    # -- CausalLMPolicy --
    def set_gradient_checkpointing(self, on: bool) -> None:
        """transformers' own switch (``train.gradient_checkpointing`` or ``policy.options.gradient_checkpointing``)."""
        if on:
            self._enable_checkpointing(self.hf_model, self.options.path)
        elif hasattr(self.hf_model, "activation_checkpointing_disable"):  # transformers >= 5.x name
            if self.hf_model.is_activation_checkpointing:
                self.hf_model.activation_checkpointing_disable()
        elif self.hf_model.is_gradient_checkpointing:
            self.hf_model.gradient_checkpointing_disable()
        self.options.gradient_checkpointing = bool(on)

    def trunk(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any = None,
        *,
        use_cache: bool = False,
        attention: str | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """The last layer's hidden states and the cache. ``attention`` names the attention implementation for this
        call (None: the generation one with ``use_cache``, the training one otherwise)."""
        o = self.options
        # Incremental decoding (use_cache) is sampling; every other forward scores or trains.
        default = (o.generation_attn_implementation or o.attn_implementation) if use_cache else o.attn_implementation
        wanted: str = attention or default
        if wanted != self._attn_now:  # switched once per phase, not per token
            self.hf_model.set_attn_implementation(wanted)
            self._attn_now = wanted
        out = self._decoder(
            input_ids=input_ids,
            attention_mask=attention_mask.to(torch.long),
            position_ids=position_ids,
            use_cache=use_cache,  # explicit: configs default to True, which would build a cache in score()
            **{self._cache_arg: cache if use_cache else None},
        )
        new_cache = getattr(out, self._cache_arg, None) if use_cache else None
        return out.last_hidden_state, new_cache

    def static_steps(
        self, max_new_tokens: int, *, share_prompts: bool = True, compile: bool = False, caches: Any = None
    ) -> Any:
        """A :class:`palestra.models.sampling.DecodeStepper` over a preallocated KV cache (the ``static_kv``
        generator's; see :mod:`palestra.plugins.policies._static_decode`), taken from ``caches`` (a ``CachePool``)
        when given."""
        from palestra.plugins.policies._static_decode import StaticSteps

        return StaticSteps(self, max_new_tokens, share_prompts=share_prompts, compile=compile, caches=caches)

    def output_head(self) -> torch.nn.Module:
        return self.hf_model.get_output_embeddings()

    def layer_groups(self) -> dict[str, list[str]]:
        """embedding: the input embeddings; decoder: the decoder's final norm, the output head (and value
        head); encoder: every other child of the decoder (the layers, rotary tables, ...)."""
        names = {id(m): n for n, m in self.named_modules(remove_duplicate=False) if n.startswith("model.")}
        embed = self.hf_model.get_input_embeddings()
        final_norm = next(
            (
                getattr(self._decoder, a)
                for a in ("norm", "final_layernorm", "ln_f")
                if isinstance(getattr(self._decoder, a, None), torch.nn.Module)
            ),
            None,
        )
        decoder = [names[id(m)] for m in (final_norm, self.hf_model.get_output_embeddings()) if m is not None]
        decoder += ["value_head"] if self.value_head is not None else []
        encoder = [names[id(m)] for m in self._decoder.children() if m is not embed and m is not final_norm]
        return {"embedding": [names[id(embed)]], "encoder": encoder, "decoder": decoder}

    @property
    def hidden_size(self) -> int:
        return int(self._text_config().hidden_size)

    def keep_untied(self) -> None:
        self.hf_model.config.tie_word_embeddings = False  # transformers' tie_weights() reads it

    def model_dims(self) -> dict[str, int]:
        text = self._text_config()
        heads = int(getattr(text, "num_attention_heads", 1) or 1)
        return {
            "layers": int(text.num_hidden_layers),
            "hidden": int(text.hidden_size),
            "heads": heads,
            "vocab": len(self.tokenizer),
        }

    def _text_config(self) -> Any:
        """The language model's config (a multimodal config nests it)."""
        config = self.hf_model.config
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    def prompt_text(self, observation: Observation) -> str:
        """The chat template over ``observation.messages`` (and its tools) when enabled and present; the prompt text
        otherwise, after the tools' description when the observation offers tools."""
        if self._use_chat and observation.messages:
            return self.chat.render(observation)
        if observation.tools and observation.tool_prompt:
            return f"{observation.tool_prompt}\n\n{observation.prompt}"
        return observation.prompt

    @functools.cached_property
    def chat(self) -> ChatRenderer:
        """How this policy renders chats and tools with its template (:mod:`palestra.plugins.policies._chat`)."""
        return ChatRenderer(self.tokenizer.hf)

    def prefix_preserving(self) -> bool:
        """Whether each turn's rendered prompt extends the last one (always, without a chat template)."""
        return not self._use_chat or self.chat.prefix_preserving

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.hf.decode([int(token_id)], skip_special_tokens=False))

    # -- export --
    def save_pretrained(self, folder: str | Path, *, merge_lora: bool = True, dtype: torch.dtype | None = None) -> None:
        """Write a transformers folder that ``AutoModelForCausalLM.from_pretrained(folder)`` loads and
        ``policy: hf`` trains further: safetensors weights in ``dtype`` (None: :attr:`source_dtype`, the dtype the
        weights were read in; bf16 for a GGUF), ``config.json`` (never a ``quantization_config``: GGUF weights were
        dequantised on load), ``generation_config.json``, and the tokenizer files with the chat template. The value
        head (PPO) is not part of a causal LM and is not written. ``merge_lora`` is accepted like every policy's;
        this one has no adapters (see :class:`LoRAHFPolicy`)."""
        del merge_lora  # every weight is a plain tensor: nothing to merge
        self._write_folder(self.hf_model, Path(folder), dtype or self.source_dtype)

    def _write_folder(self, model: Any, folder: Path, dtype: torch.dtype) -> None:
        """``model`` written in ``dtype`` without casting it: the live policy keeps its weights as they are."""
        folder.mkdir(parents=True, exist_ok=True)
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.state_dict().items()}
        model.save_pretrained(folder, state_dict=weights)
        # transformers writes the live model's dtype into config.json; it must say what the files hold
        config_file = folder / "config.json"
        config = json.loads(config_file.read_text(encoding="utf-8"))
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = str(dtype).removeprefix("torch.")
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        self.tokenizer.hf.save_pretrained(folder)


class BaseReference(torch.nn.Module):
    """A LoRA policy's frozen base as the KL reference: ``score`` (``CausalLMPolicy.score``'s signature) runs the
    policy with its adapters disabled. It owns no parameters and holds the policy only through its bound
    ``score_base``, not as a submodule: the learner freezes and moves its reference (``requires_grad_(False)``,
    ``.to("cpu")`` for ``train.offload_reference``), which must not touch the live policy."""

    __module__ = "palestra.plugins.policies.hf"

    def __init__(self, score_base: Any) -> None:
        super().__init__()
        self._score_base = score_base

    def score(self, *args: Any, **kwargs: Any) -> Any:
        return self._score_base(*args, **kwargs)


class LoRAHFPolicy(HFPolicy):
    """:class:`HFPolicy` training LoRA adapters over its frozen weights: a :class:`palestra.types.AdapterPolicy`.

    ``self.model`` is peft's ``PeftModel`` around the transformers model (adapters injected into the
    ``lora.target_modules`` layers; every other weight frozen), so the learner's optimiser, which takes the
    parameters that require grad, holds only the adapters (and a PPO value head). The KL reference is this
    same model with the adapters disabled (:meth:`base_reference`): no second copy of the weights. Checkpoints
    hold :meth:`adapter_state_dict`; resuming rebuilds the base from its files and loads the adapters back.
    """

    __module__ = "palestra.plugins.policies.hf"

    def _adapt(self, model: Any, source: str) -> Any:
        import peft

        lora = self.options.lora
        assert lora is not None  # a LoRAHFPolicy is built only when options.lora is set
        targets = _check_targets(model, lora.target_modules, source)
        config = peft.LoraConfig(
            r=lora.r,
            # peft annotates lora_alpha as int, but only ever divides it by r: a float alpha is used as given
            lora_alpha=lora.alpha,  # type: ignore[arg-type]
            lora_dropout=lora.dropout,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
        )
        try:
            with warnings.catch_warnings():
                # peft reads transformers' deprecated `is_gradient_checkpointing`; nothing a user can act on
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
                wrapped = peft.get_peft_model(model, config)
        except ValueError as e:  # no default targets for this architecture, an unsupported layer, ...
            raise ConfigError(
                f"{WHERE}.lora.target_modules: cannot add LoRA adapters to the model at {source!r}: {_first_line(e)}"
            ) from None
        # exactly the tensors peft left trainable, by their names in this policy (it holds the wrapper as "model")
        self._adapter_names = frozenset(f"model.{n}" for n, p in wrapped.named_parameters() if p.requires_grad)
        return wrapped

    @property
    def hf_model(self) -> Any:
        return self.model.get_base_model()

    # -- palestra.types.AdapterPolicy --
    def base_reference(self) -> torch.nn.Module:
        """The KL reference: a module whose ``score`` runs this policy with its adapters disabled (see
        :class:`BaseReference`)."""
        return BaseReference(self.score_base)

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable tensors by their names in :meth:`state_dict`: every adapter, and the value head if any."""
        return {k: v for k, v in self.state_dict().items() if k in self._adapter_names or k.startswith("value_head.")}

    def load_adapter_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Put back what :meth:`adapter_state_dict` returned; the frozen base is left as loaded from its files.
        A missing or extra name is a KeyError naming it; a shape mismatch torch's RuntimeError."""
        expected = self.adapter_state_dict()
        missing = next((k for k in expected if k not in state), None)
        if missing is not None:
            raise KeyError(f"the adapter state has no {missing!r}")
        extra = next((k for k in state if k not in expected), None)
        if extra is not None:
            raise KeyError(f"the adapter state has {extra!r}, which is not an adapter of this policy")
        self.load_state_dict(dict(state), strict=False)

    # -- the frozen base --
    @contextmanager
    def adapters_disabled(self) -> Iterator[None]:
        """The base model for the block: peft's own switch (the adapters stay in memory, untouched)."""
        with self.model.disable_adapter():
            yield

    def score_base(self, *args: Any, **kwargs: Any) -> Any:
        """:meth:`score` of the frozen base, in eval mode as a reference is (no dropout), without gradients;
        every module's mode is put back afterwards."""
        modes = [(m, m.training) for m in self.modules()]
        self.eval()
        try:
            with torch.no_grad(), self.adapters_disabled():
                return self.score(*args, **kwargs)
        finally:
            for module, training in modes:
                module.training = training

    # -- export --
    def save_pretrained(self, folder: str | Path, *, merge_lora: bool = True, dtype: torch.dtype | None = None) -> None:
        """Write a transformers folder (see :meth:`HFPolicy.save_pretrained`; ``dtype`` likewise: the merge is
        computed in the weights' own dtype, then the result is written in ``dtype``).

        ``merge_lora=True``: the adapters folded into the weights, a plain model. ``merge_lora=False``: the base
        weights plus peft's adapter (``adapter_config.json``, ``adapter_model.safetensors``) in the same folder;
        ``AutoModelForCausalLM.from_pretrained(folder)`` then loads the base with the adapter applied (peft
        installed), and ``peft.AutoPeftModelForCausalLM.from_pretrained(folder)`` a ``PeftModel`` (its
        ``base_model_name_or_path`` is this folder's absolute path). Both work on a copy: the policy keeps its
        adapters unmerged, bit for bit (merging and unmerging in place would round the base weights).
        """
        folder = Path(folder)
        copied = copy.deepcopy(self.model)
        dtype = dtype or self.source_dtype
        if merge_lora:
            self._write_folder(copied.merge_and_unload(), folder, dtype)
            return
        self._write_folder(copied.unload(), folder, dtype)
        self.model.save_pretrained(folder)
        adapter_config = folder / "adapter_config.json"
        record = json.loads(adapter_config.read_text(encoding="utf-8"))
        record["base_model_name_or_path"] = str(folder.resolve())  # the base is in this folder, not where it was read
        adapter_config.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
