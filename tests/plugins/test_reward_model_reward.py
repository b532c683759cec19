"""The ``reward_model`` reward against tiny sequence classifiers built here (transformers' own classes, saved to a
folder; nothing downloaded). The reference is each model's own forward on one row at a time."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported anywhere in this test
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest
import tiny_hf
import torch

from palestra.config import ConfigError, build_component
from palestra.testing import check_reward

transformers = pytest.importorskip("transformers")

PROMPTS = ["What is 12 + 7?", "1+1=", "the quick brown fox", "What is 305 + 48 = ?"]
COMPLETIONS = ["<answer>19</answer>", "2", "jumps over the lazy dog", "The answer is <answer>353</answer>"]
META: list[dict[str, Any]] = [{}] * len(PROMPTS)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def classifier(folder: Path, *, labels: int, pad: bool, chat: bool = False, seed: int = 0) -> Path:
    """A tiny Llama (or, with ``chat``, Qwen2 with a ChatML template) sequence classifier with ``labels`` classes."""
    tokenizer = tiny_hf.build_tokenizer(
        add_bos=not chat, pad=pad, chat_template=tiny_hf.CHATML_TEMPLATE if chat else None
    )
    config_cls, model_cls = (
        (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification)
        if chat
        else (transformers.LlamaConfig, transformers.LlamaForSequenceClassification)
    )
    model = tiny_hf._init_model(
        config_cls,
        model_cls,
        seed,
        vocab_size=len(tokenizer),
        num_labels=labels,
        pad_token_id=tokenizer.pad_token_id if pad else None,
        eos_token_id=tokenizer.eos_token_id,
    )
    return tiny_hf._save(model, tokenizer, folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reward-models")
    return {
        "one": classifier(root / "one", labels=1, pad=True),
        "two": classifier(root / "two", labels=2, pad=False),  # no pad token anywhere: batches pad with a free id
        "three": classifier(root / "three", labels=3, pad=True),
        "chat": classifier(root / "chat", labels=1, pad=True, chat=True),
        "causal": tiny_hf.build_llama(root / "causal"),
        "root": root,
    }


def build(path: Path | str, where: str = "reward", **options: Any) -> Any:
    return build_component("reward", {"name": "reward_model", "options": {"path": str(path), **options}}, path=where)


def reference_logits(folder: Path, *, chat: bool = False) -> torch.Tensor:
    """``[B, classes]``: the model's own forward on each (prompt, completion), one row at a time, unpadded."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    rows = []
    for prompt, completion in zip(PROMPTS, COMPLETIONS):
        if chat:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            enc = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False, return_tensors="pt")
        else:
            enc = tok(prompt, completion, return_tensors="pt")
        with torch.no_grad():
            rows.append(model(**enc).logits[0])
    return torch.stack(rows)


def test_a_single_logit_head_scores_as_the_models_own_forward(folders: dict[str, Path]) -> None:
    expected = reference_logits(folders["one"])[:, 0]
    for batch_size in (1, 3, 8):  # batched and padded, or one at a time: the same scores
        got = build(folders["one"], device="cpu", batch_size=batch_size)(PROMPTS, COMPLETIONS, META).scores
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert len(set(expected.tolist())) == len(PROMPTS)  # the rows differ: the comparison means something
    probability = build(folders["one"], device="cpu", output="probability")(PROMPTS, COMPLETIONS, META).scores
    torch.testing.assert_close(probability, torch.sigmoid(expected), rtol=1e-5, atol=1e-6)
    normalised = build(folders["one"], device="cpu", center=0.5, scale=2.0)(PROMPTS, COMPLETIONS, META).scores
    torch.testing.assert_close(normalised, (expected - 0.5) / 2.0, rtol=1e-5, atol=1e-5)


def test_a_two_class_head_scores_the_positive_class(folders: dict[str, Path]) -> None:
    logits = reference_logits(folders["two"])
    got = build(folders["two"], device="cpu", batch_size=4)(PROMPTS, COMPLETIONS, META).scores
    torch.testing.assert_close(got, logits[:, 1], rtol=1e-5, atol=1e-5)  # the model has no pad token: a free id pads
    prob = build(folders["two"], device="cpu", output="probability", positive_label=0)(PROMPTS, COMPLETIONS, META)
    torch.testing.assert_close(prob.scores, torch.softmax(logits, -1)[:, 0], rtol=1e-5, atol=1e-6)


def test_the_chat_template_renders_the_pair(folders: dict[str, Path]) -> None:
    reward = build(folders["chat"], device="cpu", batch_size=4)
    torch.testing.assert_close(
        reward(PROMPTS, COMPLETIONS, META).scores,
        reference_logits(folders["chat"], chat=True)[:, 0],
        rtol=1e-5,
        atol=1e-5,
    )
    row = reward.reward.encode("hi", "hello")["input_ids"]
    text = reward.reward.tokenizer.decode(row)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>") and "<|im_start|>assistant\nhello" in text
    off = build(folders["chat"], device="cpu", chat_template="off")
    assert off.reward.encode("hi", "hello")["input_ids"] == off.reward.tokenizer("hi", "hello")["input_ids"]


def test_max_length_keeps_the_end_of_each_row(folders: dict[str, Path]) -> None:
    reward = build(folders["one"], device="cpu", max_length=5).reward
    full = build(folders["one"], device="cpu").reward.encode(PROMPTS[3], COMPLETIONS[3])["input_ids"]
    assert reward.encode(PROMPTS[3], COMPLETIONS[3])["input_ids"] == full[-5:]
    assert reward(PROMPTS, COMPLETIONS, META).shape == (4,)


def test_copies_share_the_model(folders: dict[str, Path]) -> None:
    reward = build(folders["one"], device="cpu")
    twin = copy.deepcopy(reward)
    assert twin.reward.model is reward.reward.model
    assert torch.equal(twin(PROMPTS, COMPLETIONS, META).scores, reward(PROMPTS, COMPLETIONS, META).scores)


def one_line(err: pytest.ExceptionInfo[BaseException], start: str) -> str:
    text = str(err.value)
    assert "\n" not in text and text.startswith(start), text
    return text


def test_bad_folders_and_options_are_one_line_naming_the_key(folders: dict[str, Path]) -> None:
    with pytest.raises(ConfigError) as err:
        build(folders["causal"])
    assert "no trained classification head" in one_line(err, "reward.options.path: ")
    with pytest.raises(ConfigError) as err:
        build(folders["root"] / "none")
    assert "does not exist" in one_line(err, "reward.options.path: ")
    with pytest.raises(ConfigError) as err:
        build(folders["three"])
    assert "3 classes (0: LABEL_0, 1: LABEL_1, 2: LABEL_2)" in one_line(err, "reward.options.positive_label: ")
    with pytest.raises(ConfigError) as err:
        build(folders["two"], positive_label=2)
    one_line(err, "reward.options.positive_label: is 2, but the model has 2 class(es)")
    with pytest.raises(ConfigError) as err:
        build(folders["one"], chat_template="on")
    one_line(err, "reward.options.chat_template: is 'on' but the tokenizer has no chat template")
    for options, start in [
        ({"scale": 0}, "reward.options.scale: "),
        ({"device": "tpu"}, "reward.options.device: "),
        ({"output": "rank"}, "reward.options.output: "),
        ({"batch_size": 0}, "reward.options.batch_size: "),
    ]:
        with pytest.raises(ConfigError) as err:
            build(folders["one"], **options)
        one_line(err, start)
    nested = {
        "components": [{"name": "correctness"}, {"name": "reward_model", "options": {"path": str(folders["causal"])}}]
    }
    with pytest.raises(ConfigError) as err:
        build_component("reward", {"name": "weighted_sum", "options": nested}, path="reward")
    one_line(err, "reward.options.components[1].options.path: ")


@pytest.mark.parametrize("name, options", [("one", {}), ("two", {"output": "probability"}), ("chat", {})])
def test_the_reward_model_passes_the_reward_contract(folders: dict[str, Path], name: str, options: dict) -> None:
    check_reward("reward_model", {"path": str(folders[name]), "device": "cpu", **options})
