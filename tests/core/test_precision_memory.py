"""Mixed precision, non-finite step skipping and the memory savers of the update (palestra.scale.precision,
palestra.scale.micro_batching, palestra.engine.learner.Learner.update), on the real tiny policy.

Gradients are compared through AdamW's first moment after one step, which is exactly ``(1 - beta1) * grad``.
Out-of-memory is injected by a policy whose ``score`` raises the real ``torch.OutOfMemoryError`` above a
token count (fault injection: the update's back-off is the part under test, and it runs for real).
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

from palestra.config import ConfigError, TrainConfig
from palestra.context import TrainContext
from palestra.engine.algorithm import Algorithm
from palestra.engine.learner import Learner
from palestra.models.policy import CausalLMPolicy
from palestra.plugin_manager import get_registry
from palestra.plugins.policies._tiny_model import TinyTransformerPolicy
from palestra.scale.micro_batching import (
    OutOfMemory,
    activation_bytes_per_token,
    auto_token_budget,
    free_memory_bytes,
    model_dims,
    plan_micro_batches,
    row_widths,
    trim_padding,
)
from palestra.types import Experience

torch.set_num_threads(1)

LENGTHS = [6, 2, 5, 1, 4, 6, 3, 2]  # completion lengths (right-padded to 6)
PROMPTS = [4, 4, 2, 2, 3, 3, 1, 1]  # prompt lengths (left-padded to 4); groups of 2 share a prompt
REWARDS = [1.0, 0.0, 0.2, 0.9, 0.0, 1.0, 0.6, 0.1]
GROUPS = [0, 0, 1, 1, 2, 2, 3, 3]


def tiny(seed: int = 0, cls: type = TinyTransformerPolicy) -> TinyTransformerPolicy:
    return cls(d_model=16, n_layers=2, n_heads=2, d_ff=32, max_len=32, seed=seed)


def make_batch(policy: CausalLMPolicy, seed: int = 3) -> Experience:
    g = torch.Generator().manual_seed(seed)
    b, p, t = len(LENGTHS), max(PROMPTS), max(LENGTHS)
    vocab = len(policy.tokenizer)
    prompt_ids = torch.randint(3, vocab, (b, p), generator=g)
    prompt_mask = torch.arange(p)[None, :] >= (p - torch.tensor(PROMPTS))[:, None]
    completion_ids = torch.randint(3, vocab, (b, t), generator=g)
    completion_mask = torch.arange(t)[None, :] < torch.tensor(LENGTHS)[:, None]
    pad = policy.tokenizer.pad_token_id
    batch = Experience(
        prompt_ids=prompt_ids.masked_fill(~prompt_mask, pad),
        prompt_mask=prompt_mask,
        completion_ids=completion_ids.masked_fill(~completion_mask, pad),
        completion_mask=completion_mask,
        behaviour_logprobs=torch.zeros(b, t),
        rewards=torch.tensor(REWARDS),
        advantages=torch.zeros(b),
        group_ids=torch.tensor(GROUPS),
        agent_ids=["assistant"] * b,
    )
    with torch.no_grad():  # on-policy: behaviour log-probs are the policy's own
        batch.behaviour_logprobs = policy.score(
            batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, entropy=False
        ).logprobs
    return batch


def train(**overrides) -> TrainConfig:
    base = {"steps": 10, "batch_size": 4, "group_size": 2, "lr": 1e-2, "max_grad_norm": None, "max_new_tokens": 6}
    base.update(overrides)
    return TrainConfig(**base)


def build(name: str = "grpo", **options) -> Algorithm:
    return get_registry().get("optimizer", name).factory(**options)


def setup(policy, name="grpo", options=None, **train_overrides) -> Learner:
    algo = build(name, **(options or {}))
    reference = copy.deepcopy(policy).eval() if algo.needs_reference else None
    return Learner(algo, policy, TrainContext.local(train(**train_overrides)), reference=reference)


def first_moment_grads(algo: Learner) -> list[torch.Tensor]:
    """The gradient of the (only) step: AdamW's exp_avg / (1 - beta1)."""
    master = algo.optimizer_set.master
    stepped = master.master if master is not None else algo.params
    return [algo.optimizer.state[p]["exp_avg"] / 0.1 for p in stepped]


def mean_logp(policy, batch, rows) -> float:
    with torch.no_grad():
        lp = policy.score(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask).logprobs
    m = batch.completion_mask[rows]
    return float((lp[rows] * m).sum() / m.sum())


# ---- mixed precision -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_updates_train_and_keep_fp32_losses(precision):
    policy = tiny()
    algo = setup(policy, precision=precision, lr=3e-2)
    batch = algo.prepare(make_batch(policy))
    good, bad = batch.advantages > 0, batch.advantages < 0
    before_good, before_bad = mean_logp(policy, batch, good), mean_logp(policy, batch, bad)

    with algo.autocast():  # the forward runs in low precision, the scores come out fp32
        scores = algo.score(batch)
        logits = policy.logits(policy.trunk(batch.prompt_ids, batch.prompt_mask, batch.prompt_mask.long())[0])
    assert logits.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert scores.logprobs.dtype == torch.float32 and scores.entropy.dtype == torch.float32
    loss, _ = algo.loss(batch)
    assert loss.dtype == torch.float32

    history = [algo.update(batch) for _ in range(8)]
    assert all(m["train/skipped"] == 0.0 for m in history)
    assert all(p.dtype == torch.float32 for p in policy.parameters())  # weights keep their dtype
    # The advantage-weighted likelihood moved the right way.
    assert mean_logp(policy, batch, good) > before_good + 0.05
    assert mean_logp(policy, batch, bad) < before_bad - 0.05
    if precision == "fp16":
        assert all("amp/loss_scale" in m and "amp/overflow" in m for m in history)
        assert sum(m["amp/overflow"] for m in history) < len(history)  # some steps were taken
    else:
        assert "amp/loss_scale" not in history[-1]


def test_fp16_scaler_state_round_trips_and_the_run_continues_bitwise():
    policy = tiny()
    algo = setup(policy, precision="fp16")
    batch = algo.prepare(make_batch(policy))
    algo.precision.load_state_dict({**algo.precision.state_dict(), "scale": 1024.0})  # not the default scale
    algo.update(batch)
    saved_policy, saved = copy.deepcopy(policy.state_dict()), copy.deepcopy(algo.state_dict())
    assert saved["precision"]["scale"] == pytest.approx(1024.0)
    assert "precision" not in setup(tiny(), precision="bf16").state_dict()

    twin = tiny(seed=7)
    twin.load_state_dict(saved_policy)
    twin_algo = setup(twin, precision="fp16")
    twin_algo.load_state_dict(saved)
    assert twin_algo.precision.scaler.state_dict() == algo.precision.scaler.state_dict()
    a, b = algo.update(batch), twin_algo.update(batch)
    assert a == b
    for x, y in zip(policy.parameters(), twin.parameters()):
        assert torch.equal(x, y)


def test_fp16_overflow_is_the_scalers_skip_not_a_bad_step():
    policy = tiny()
    algo = setup(policy, precision="fp16")
    batch = algo.prepare(make_batch(policy))
    algo.precision.load_state_dict({**algo.precision.state_dict(), "scale": 3e38})  # scaled gradients overflow fp16
    before = [p.detach().clone() for p in policy.parameters()]
    m = algo.update(batch)
    assert m["train/skipped"] == 0.0 and m["amp/overflow"] == 1.0
    assert m["amp/loss_scale"] == pytest.approx(1.5e38)  # backed off
    assert all(torch.equal(a, p) for a, p in zip(before, policy.parameters()))


def test_fp16_with_fp16_weights_is_a_one_line_config_error():
    policy = tiny().to(torch.float16)
    with pytest.raises(ConfigError, match=r"^train.precision: fp16 loss scaling needs float32"):
        setup(policy, precision="fp16")


# ---- non-finite steps -------------------------------------------------------------------------------------------
def test_a_non_finite_loss_skips_the_step_with_one_warning_line(caplog):
    policy = tiny()
    algo = setup(policy, grad_accum=2)
    batch = algo.prepare(make_batch(policy))
    poisoned = copy.deepcopy(batch)
    poisoned.advantages[3] = math.nan
    before = [p.detach().clone() for p in policy.parameters()]
    with caplog.at_level(logging.WARNING, logger="palestra.engine.learner"):
        m = algo.update(poisoned)
    assert m["train/skipped"] == 1.0 and all(math.isfinite(v) for v in m.values())
    assert all(torch.equal(a, p) for a, p in zip(before, policy.parameters()))
    assert all(p.grad is None for p in policy.parameters())
    assert algo.optimizer.state == {}  # no optimiser step
    assert algo.scheduler.last_epoch == 0  # no schedule step either
    [record] = caplog.records
    assert "\n" not in record.getMessage()
    assert record.getMessage().startswith(
        "grpo.update: skipped the optimiser step: non-finite loss (nan) in pass 0, micro-batch "
    )
    # The next good batch trains normally.
    m = algo.update(batch)
    assert m["train/skipped"] == 0.0 and algo.scheduler.last_epoch == 1


def test_a_non_finite_gradient_skips_the_step(caplog):
    policy = tiny()
    algo = setup(policy)
    batch = algo.prepare(make_batch(policy))
    handle = policy.blocks[0].mlp.down.weight.register_hook(lambda g: torch.full_like(g, math.inf))
    with caplog.at_level(logging.WARNING, logger="palestra.engine.learner"):
        m = algo.update(batch)
    handle.remove()
    assert m["train/skipped"] == 1.0
    assert "non-finite gradient norm (inf) in pass 0" in caplog.records[0].getMessage()


def test_grad_sync_hook_is_called_once_per_pass_before_clipping():
    policy = tiny()
    calls = []
    context = TrainContext(
        train=train(grad_accum=2, updates_per_batch=3),
        grad_sync=lambda params: calls.append((len(params), all(p.grad is not None for p in params))),
    )
    algo = Learner(build("grpo"), policy, context)
    algo.update(algo.prepare(make_batch(policy)))
    assert calls == [(len(algo.params), True)] * 3


# ---- token-budget micro-batches ------------------------------------------------------------------------------------
def test_token_budget_packs_sorted_rows_within_the_budget():
    policy = tiny()
    batch = make_batch(policy)
    p, t = row_widths(batch)
    assert p.tolist() == PROMPTS and t.tolist() == LENGTHS
    chunks = plan_micro_batches(batch, 24, torch.Generator().manual_seed(0))
    assert sorted(i for c in chunks for i in c.tolist()) == list(range(len(LENGTHS)))
    assert len(chunks) > 2
    for c in chunks:
        micro = trim_padding(batch.select(c))
        assert micro.batch_size * (micro.prompt_ids.shape[1] + micro.completion_ids.shape[1]) <= 24


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("grpo", {"loss_agg": "token_mean", "beta": 0.1}),
        ("grpo", {"loss_agg": "seq_mean_token_mean"}),
        ("dr_grpo", {}),  # seq_mean_token_sum_norm
        ("ppo", {}),
    ],
)
def test_token_budget_accumulation_is_exact(name, options):
    results = []
    for budget in (None, 20, 11):
        policy = tiny()
        algo = setup(policy, name, options, token_budget=budget)
        m = algo.update(algo.prepare(make_batch(policy)))
        results.append((first_moment_grads(algo), m))
    (g1, m1) = results[0]
    for gk, mk in results[1:]:
        for a, b in zip(g1, gk):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert mk["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-7)
        assert mk["policy/entropy"] == pytest.approx(m1["policy/entropy"], rel=1e-5)
    assert results[2][1]["memory/token_budget"] == 11.0


def test_a_row_bigger_than_the_token_budget_is_a_one_line_error():
    policy = tiny()
    algo = setup(policy, token_budget=9)
    with pytest.raises(
        ValueError, match=r"^grpo: train.token_budget=9 is smaller than row 0 of the batch, which needs 10 tokens"
    ):
        algo.update(algo.prepare(make_batch(policy)))


# ---- automatic micro-batch size and out-of-memory back-off -----------------------------------------------------------
class OOMAbove(TinyTransformerPolicy):
    """Raises the real CUDA out-of-memory exception when one score() call sees more than ``limit`` tokens."""

    limit = 10**9
    calls: list[int]

    def score(self, prompt_ids, prompt_mask, completion_ids, completion_mask, **kw):
        tokens = prompt_ids.numel() + completion_ids.numel()
        type(self).calls.append(tokens)
        if tokens > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate for {tokens} tokens")
        return super().score(prompt_ids, prompt_mask, completion_ids, completion_mask, **kw)


def test_out_of_memory_halves_the_budget_and_the_gradient_stays_exact(caplog):
    OOMAbove.calls = []
    ref_policy = tiny()
    ref_algo = setup(ref_policy, "grpo", {"beta": 0.1})
    ref_metrics = ref_algo.update(ref_algo.prepare(make_batch(ref_policy)))

    OOMAbove.limit = 25
    policy = tiny(cls=OOMAbove)
    algo = setup(policy, "grpo", {"beta": 0.1}, auto_micro_batch=True)
    with caplog.at_level(logging.WARNING, logger="palestra.engine.learner"):
        batch = algo.prepare(make_batch(tiny()))  # the reference scoring backs off too
        m = algo.update(batch)
    assert m["train/skipped"] == 0.0
    assert m["memory/token_budget"] <= 25 and algo.planner.auto_budget_cap <= 25
    assert max(OOMAbove.calls) > 25  # it really ran out first
    assert any("out of memory at a budget of" in r.getMessage() for r in caplog.records)
    for a, b in zip(first_moment_grads(ref_algo), first_moment_grads(algo)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert m["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_out_of_memory_with_one_row_per_micro_batch_gives_up_in_one_line():
    OOMAbove.calls, OOMAbove.limit = [], 0
    policy = tiny(cls=OOMAbove)
    algo = setup(policy, auto_micro_batch=True)
    batch = make_batch(tiny())
    batch.advantages = torch.ones(batch.batch_size)
    with pytest.raises(
        OutOfMemory, match=r"^grpo.update: out of memory with one row per micro-batch .*train.auto_micro_batch"
    ) as e:
        algo.update(batch)
    assert "\n" not in str(e.value)


def test_automatic_budget_follows_free_memory_and_the_model():
    policy = tiny()
    assert free_memory_bytes(torch.device("cpu")) > 0
    dims = model_dims(policy)
    assert dims == {"layers": 2, "hidden": 16, "heads": 2, "vocab": len(policy.tokenizer)}
    per = activation_bytes_per_token(dims, 16, 4)
    assert activation_bytes_per_token(dims, 16, 4, checkpointing=True) < per
    one = auto_token_budget(policy, torch.device("cpu"), 16, 4, free_bytes=10**8)
    assert one == int(10**8 * 0.5 / per)
    assert auto_token_budget(policy, torch.device("cpu"), 16, 4, free_bytes=2 * 10**8) in (2 * one, 2 * one + 1)
    algo = setup(policy, auto_micro_batch=True, token_budget=30)
    assert algo.planner.token_budget(make_batch(policy)) == 30  # the token budget caps the estimate


# ---- offload ---------------------------------------------------------------------------------------------------------
def test_offload_matches_the_plain_run_and_keeps_state_on_the_cpu():
    runs = []
    for offload in (False, True):
        policy = tiny()
        algo = setup(policy, "grpo", {"beta": 0.1}, offload_reference=offload, offload_optimizer=offload, grad_accum=2)
        metrics = [algo.update(algo.prepare(make_batch(policy, seed=s))) for s in (3, 4, 5)]
        runs.append((policy, algo, metrics))
    (plain, _, m_plain), (off, algo, m_off) = runs
    for a, b in zip(plain.parameters(), off.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    for a, b in zip(m_plain, m_off):
        assert b == pytest.approx(a, rel=1e-6, abs=1e-9)
    assert algo.optimizer_set.master is not None and len(algo.optimizer_set.master.master) == len(algo.params)
    assert all(m.device.type == "cpu" and m.dtype == torch.float32 for m in algo.optimizer_set.master.master)
    assert all(m is not p for m, p in zip(algo.optimizer_set.master.master, algo.params))
    states = [t for s in algo.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert states and all(t.device.type == "cpu" for t in states)
    assert next(algo.reference.parameters()).device.type == "cpu"
    saved = algo.state_dict()
    assert len(saved["master"]) == len(algo.params) and "master" not in runs[0][1].state_dict()
    for m, p in zip(saved["master"], algo.params):
        torch.testing.assert_close(m, p.detach(), rtol=0, atol=0)


# ---- gradient checkpointing ------------------------------------------------------------------------------------------
def test_gradient_checkpointing_gives_the_same_gradients():
    results = []
    for on in (False, True):
        policy = tiny()
        algo = setup(policy, "ppo", gradient_checkpointing=on)
        assert policy.options.gradient_checkpointing is on
        algo.update(algo.prepare(make_batch(policy)))
        results.append(first_moment_grads(algo))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_gradient_checkpointing_on_a_policy_without_it_is_a_config_error():
    class Plain(TinyTransformerPolicy):
        set_gradient_checkpointing = CausalLMPolicy.set_gradient_checkpointing

    with pytest.raises(ConfigError, match=r"^train.gradient_checkpointing: the policy Plain does not support"):
        setup(tiny(cls=Plain), gradient_checkpointing=True)


def test_the_hf_policy_switches_transformers_checkpointing_on_and_off(tmp_path):
    pytest.importorskip("transformers")
    import tiny_hf

    from palestra.config import build_component

    folder = tiny_hf.build_qwen2(tmp_path / "qwen2")
    policy = build_component("policy", {"name": "hf", "options": {"path": str(folder)}}, path="policy")
    flag = (
        "is_activation_checkpointing"
        if hasattr(policy.model, "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    assert not getattr(policy.model, flag)
    setup(policy, gradient_checkpointing=True)
    assert getattr(policy.model, flag) and policy.options.gradient_checkpointing
    policy.set_gradient_checkpointing(False)
    assert not getattr(policy.model, flag) and not policy.options.gradient_checkpointing
