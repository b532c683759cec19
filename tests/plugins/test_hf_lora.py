"""LoRA on the ``hf`` policy (``policy.options.lora``, through peft), on tiny locally built models: the adapters are
all the optimiser holds, the KL reference is the same model with its adapters disabled, checkpoints hold only the
adapters, and ``save_pretrained`` writes folders transformers (and peft) load with the policy's logits.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import tiny_hf

from palestra.config import ConfigError, build_component, validate_config
from palestra.engine import checkpoint as ckpt
from palestra.models.policy import CausalLMPolicy
from palestra.types import AdapterPolicy

pytestmark = pytest.mark.usefixtures("one_thread")

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-hf-lora")
    return {"llama": tiny_hf.build_llama(root / "llama"), "qwen2": tiny_hf.build_qwen2(root / "qwen2")}


def build(path: Path, **options: Any) -> CausalLMPolicy:
    return build_component("policy", {"name": "hf", "options": {"path": str(path), **options}}, path="policy")


def perturb_adapters(policy: CausalLMPolicy, seed: int = 0) -> None:
    """LoRA's B starts at zero (the adapted model equals the base); give it values so the adapters matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def batch(policy: CausalLMPolicy) -> tuple[torch.Tensor, ...]:
    from palestra.types import Observation

    prompt_ids, prompt_mask = policy.encode_observations([Observation("1+1="), Observation("What is 12 + 7?")])
    g = torch.Generator().manual_seed(1)
    completion = torch.randint(0, len(policy.tokenizer), (2, 5), generator=g)
    return prompt_ids, prompt_mask, completion, torch.ones_like(completion, dtype=torch.bool)


def logprobs(model: Any, policy: CausalLMPolicy) -> torch.Tensor:
    with torch.no_grad():
        return model.score(*batch(policy), entropy=False).logprobs


# ---- the adapters --------------------------------------------------------------------------------------
def test_only_the_adapters_train_and_only_a_lora_policy_is_an_adapter_policy(folders: dict[str, Path]) -> None:
    plain = build(folders["llama"])
    assert not isinstance(plain, AdapterPolicy)  # the trainer deep-copies its reference and saves every weight
    policy = build(folders["llama"], lora=LORA)
    assert isinstance(policy, AdapterPolicy) and type(policy).__name__ == "LoRAHFPolicy"
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert adapted == {"q_proj", "v_proj", "up_proj"}
    assert set(policy.adapter_state_dict()) == trainable
    # 2 layers x 3 modules x (A: r x in + B: out x r)
    assert sum(p.numel() for n, p in policy.named_parameters() if n in trainable) < 0.2 * sum(
        p.numel() for p in plain.parameters()
    )


def test_null_targets_take_peft_defaults_and_all_linear_adapts_every_linear_layer(folders: dict[str, Path]) -> None:
    default = build(folders["qwen2"], lora={})
    assert sorted(default.model.peft_config["default"].target_modules) == ["q_proj", "v_proj"]
    every = build(folders["qwen2"], lora={"target_modules": "all-linear"})
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in every.adapter_state_dict()}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"target_modules": ["q_proj", "qproj"]},
         r"^policy\.options\.lora\.target_modules\[1\]: 'qproj' matches no module of the model at '.+'; "
         r"the layers LoRA can adapt: down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, "
         r"v_proj$"),
        ({"target_modules": ["input_layernorm"]},
         r"^policy\.options\.lora\.target_modules\[0\]: 'input_layernorm' "
         r"names LlamaRMSNorm modules, which LoRA cannot adapt"),
        ({"target_modules": []}, r"^policy\.options\.lora\.target_modules: is an empty list"),
        ({"target_modules": "attention"},
         r"^policy\.options\.lora\.target_modules: a string must be 'all-linear', got 'attention'"),
        ({"r": 0}, r"^policy\.options\.lora\.r: must be >= 1, got 0$"),
        ({"alpha": -1}, r"^policy\.options\.lora\.alpha: must be > 0"),
        ({"dropout": 1.0}, r"^policy\.options\.lora\.dropout: must be < 1\.0, got 1\.0$"),
        ({"rank": 8}, r"^policy\.options\.lora\.rank: unknown key"),
    ],
)  # fmt: skip
def test_bad_lora_options_are_one_line_naming_the_key(
    folders: dict[str, Path], lora: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        build(folders["llama"], lora=lora)
    assert "\n" not in str(caught.value)


def test_gradient_checkpointing_gives_the_adapters_the_same_gradients(folders: dict[str, Path]) -> None:
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the same adapter initialisation
        policy = build(folders["llama"], lora=LORA, gradient_checkpointing=checkpointing)
        perturb_adapters(policy)
        policy.score(*batch(policy)).logprobs.sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and all(g.abs().sum() > 0 for g in grads[0].values())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6)


# ---- the reference is the frozen base --------------------------------------------------------------------
def test_the_base_reference_is_the_policy_with_adapters_disabled_and_owns_nothing(folders: dict[str, Path]) -> None:
    plain = build(folders["llama"])
    policy = build(folders["llama"], lora={**LORA, "dropout": 0.5})
    reference = policy.base_reference()
    torch.testing.assert_close(logprobs(policy.eval(), policy), logprobs(plain, plain), rtol=0, atol=1e-6)  # B = 0
    perturb_adapters(policy)
    policy.train()  # the learner scores the reference while the policy is in training mode
    adapted = logprobs(policy.eval(), policy)
    policy.train()
    assert (adapted - logprobs(plain, plain)).abs().max() > 1e-2  # the adapters matter now
    base = logprobs(reference, policy)  # eval mode inside (no adapter dropout), adapters off
    torch.testing.assert_close(base, logprobs(plain.eval(), plain), rtol=0, atol=1e-6)
    assert all(m.training for m in policy.modules())  # modes put back
    # the learner freezes and moves its reference: harmless, the reference owns no parameters or buffers
    assert list(reference.parameters()) == [] and list(reference.buffers()) == []
    reference.requires_grad_(False).to("cpu").eval()
    assert all(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)
    assert policy.training
    # adapters back on after the reference scored
    torch.testing.assert_close(logprobs(policy.eval(), policy), adapted, rtol=0, atol=0)


def make_config(folder: Path, output_dir: Path, *, algorithm: str = "grpo", steps: int = 2) -> Any:
    options = {"grpo": {"beta": 0.1}, "ppo": {"kl_coef": 0.1, "vf_coef": 0.1}}[algorithm]
    return validate_config({
        "run": {"name": "lora", "seed": 0, "output_dir": str(output_dir)},
        "environment": {"name": "arithmetic", "options": {"difficulty": 1}},
        # partial credit: rewards vary in a group
        "reward": {"name": "length", "options": {"target": 8, "unit": "chars"}},
        "policy": {"name": "hf", "options": {"path": str(folder), "lora": LORA}},
        "optimizer": {"name": algorithm, "options": options},
        "loggers": [],
        "kernels": {"backend": "torch"},
        "train": {"steps": steps, "batch_size": 2, "group_size": 4, "lr": 1e-2, "max_new_tokens": 6, "eval_size": 2,
                  "device": "cpu"},
    })  # fmt: skip


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_the_trainer_optimises_only_adapters_against_the_frozen_base(
    folders: dict[str, Path], tmp_path: Path, algorithm: str
) -> None:
    from palestra.engine.trainer import Trainer

    trainer = Trainer(make_config(folders["qwen2"], tmp_path, algorithm=algorithm), run_dir=tmp_path / "run")
    policy = trainer.policy
    assert type(trainer.reference).__name__ == "BaseReference"  # no deep copy of the model
    optimised = {id(p) for opt in trainer.learner.optimizers.values() for g in opt.param_groups for p in g["params"]}
    names = {n for n, p in policy.named_parameters() if id(p) in optimised}
    heads = {"value_head.weight", "value_head.bias"} if algorithm == "ppo" else set()
    assert names == {n for n in policy.adapter_state_dict() if "lora_" in n} | heads  # the value head stays trainable
    before = {k: v.detach().clone() for k, v in policy.named_parameters()}  # every tensor once, under one name
    history = [trainer.step() for _ in range(2)]
    assert all(math.isfinite(v) for m in history for v in m.values())
    after = dict(policy.named_parameters())
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and moved <= set(policy.adapter_state_dict())  # the base never moves
    assert any("lora_B" in k for k in moved)
    assert any(m["policy/kl"] != 0 for m in history)  # the adapted policy drifted from its base

    state = trainer.state_dict()
    assert state["policy_adapters"] is True and set(state["policy"]) == set(policy.adapter_state_dict())
    # a fresh trainer (the base rebuilt from the model files) takes the adapters back
    again = Trainer(make_config(folders["qwen2"], tmp_path, algorithm=algorithm), run_dir=tmp_path / "again")
    again.load_state(state)
    live = again.policy.state_dict()
    assert all(torch.equal(live[k], after[k]) for k in after)


def test_a_lora_checkpoint_that_does_not_fit_is_one_line(folders: dict[str, Path], tmp_path: Path) -> None:
    from palestra.engine.trainer import Trainer

    trainer = Trainer(make_config(folders["qwen2"], tmp_path), run_dir=tmp_path / "run")
    state = trainer.state_dict()
    path = ckpt.save_checkpoint(state, tmp_path / "good.pt")
    loaded = ckpt.load_checkpoint(path)  # weights_only and checksum, as for any checkpoint
    name = next(k for k in loaded["policy"] if "lora_A" in k)
    wrong = {**loaded, "policy": {**loaded["policy"], name: torch.zeros(3, 3)}}
    with pytest.raises(
        ckpt.CheckpointError, match=rf"parameter '{name}' is \[3, 3\] in the checkpoint and \[4, 32\] in the policy"
    ):
        trainer.load_state(wrong, source="wrong.pt")
    missing = {**loaded, "policy": {k: v for k, v in loaded["policy"].items() if k != name}}
    with pytest.raises(ckpt.CheckpointError, match=rf"parameter '{name}' \[4, 32\] is not in the checkpoint"):
        trainer.load_state(missing, source="missing.pt")
    full = {**loaded, "policy_adapters": False}
    with pytest.raises(
        ckpt.CheckpointError, match=r"holds every weight but the policy built from its config .* trains LoRA adapters"
    ):
        trainer.load_state(full, source="full.pt")


# ---- save_pretrained -------------------------------------------------------------------------------------
@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute")  # AutoPeft on a folder that has both
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft reads it
def test_save_pretrained_writes_a_folder_transformers_loads_with_the_policys_logits(
    folders: dict[str, Path], tmp_path: Path, merge: bool
) -> None:
    from transformers import AutoModelForCausalLM

    policy = build(folders["qwen2"], lora=LORA).eval()
    perturb_adapters(policy)
    kept = {k: v.clone() for k, v in policy.state_dict().items()}
    out = tmp_path / "out"
    policy.save_pretrained(out, merge_lora=merge)
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    assert ("adapter_config.json" in files) is (not merge) and ("adapter_model.safetensors" in files) is (not merge)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert all(torch.equal(v, kept[k]) for k, v in policy.state_dict().items())  # the policy is untouched
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert not any("lora_" in n for n, _ in model.named_parameters()) if merge else True
    ids = torch.tensor([policy.tokenizer.encode("What is 12 + 7? <answer>19</answer>")])
    with torch.no_grad():
        want = policy.model(ids).logits
        torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=1e-4)
    if not merge:  # and peft's own loader: a PeftModel on the base written beside the adapter
        from peft import AutoPeftModelForCausalLM

        config = json.loads((out / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(out.resolve())
        peft_model = AutoPeftModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
        with torch.no_grad():
            torch.testing.assert_close(peft_model(ids).logits, want, rtol=0, atol=1e-4)
