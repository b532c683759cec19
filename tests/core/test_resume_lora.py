"""Exact resume of a LoRA run: a ``palestra train`` on a tiny local HuggingFace model with LoRA adapters, SIGKILLed
mid-training and resumed with ``--resume``, ends with the same adapters, optimiser state and metrics, bitwise, as
one that never stopped; its checkpoints hold only the adapters (the base is rebuilt from the model files).
The helpers are the full-weight resume test's (tests/core/test_resume.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

pytest.importorskip("transformers")
pytest.importorskip("peft")

import tiny_hf
from test_resume import killed_and_resumed, metric_lines

from palestra.engine import checkpoint as ckpt

STEPS, SAVE_EVERY = 8, 2


def lora_sections(model_dir: Path) -> dict[str, Any]:
    # GRPO with a KL term: the reference is the base with the adapters disabled; adapter dropout draws from the
    # global RNG, which the checkpoint must carry; the length reward gives partial credit, so the adapters move.
    return {
        "environment": {"name": "arithmetic", "options": {"difficulty": 1, "terms": 2, "operations": ["+"]}},
        "reward": {"name": "length", "options": {"target": 8, "unit": "chars"}},
        "policy": {"name": "hf", "options": {
            "path": str(model_dir), "dtype": "float32",
            "lora": {"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]},
        }},
        "optimizer": {"name": "grpo", "options": {"beta": 0.05}},
    }  # fmt: skip


@pytest.mark.slow
def test_a_lora_run_killed_mid_training_resumes_to_the_same_adapters_bitwise(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    model_dir = tiny_hf.build_qwen2(tmp_path / "model")
    config = tmp_path / "config.yaml"
    raw = raw_config(
        sections=lora_sections(model_dir), steps=STEPS, batch_size=2, lr=1e-2, eval_size=2, save_every=SAVE_EVERY
    )
    config.write_text(yaml.safe_dump(raw))
    # the model folder lies outside the run: a resume uses it only when the user names it again
    run_a, run_b = killed_and_resumed(
        config, tmp_path, steps=STEPS, save_every=SAVE_EVERY, timeout=180, again=(f"policy.options.path={model_dir}",)
    )

    a = ckpt.load_checkpoint(run_a / ckpt.FINAL_NAME)  # weights_only, checksum verified
    b = ckpt.load_checkpoint(run_b / ckpt.FINAL_NAME)
    assert a["step"] == b["step"] == STEPS
    assert a["policy_adapters"] is b["policy_adapters"] is True
    # only the adapters: two layers x (q_proj, v_proj) x (A, B), no base weight
    assert len(a["policy"]) == 8 and all(".lora_A." in k or ".lora_B." in k for k in a["policy"])
    assert a["policy"].keys() == b["policy"].keys()
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"]), "adapters differ after resume"
    assert any(
        k for k in a["policy"] if "lora_B" in k and a["policy"][k].abs().sum() > 0
    )  # they trained (B starts at 0)
    opt_a, opt_b = a["optimizer"]["optimizer"]["state"], b["optimizer"]["optimizer"]["state"]
    assert len(opt_a) == 8 and all(torch.equal(opt_a[i][k], opt_b[i][k]) for i in opt_a for k in opt_a[i])
    assert metric_lines(run_a) == metric_lines(run_b)
