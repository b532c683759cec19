"""The ``static_kv`` generator on real (tiny, locally built) HuggingFace models: it samples what ``kv_cache`` samples.

Greedy outputs equal the ``kv_cache`` loop's (fp32 and bf16), seeded draws are the same tokens with the same
behaviour log-probs, those log-probs match ``policy.score``, and many draws follow the model's distribution, at the
first token (the prefill) and at the second (a decode step over the static cache).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import tiny_hf
import torch

from palestra.config import ConfigError, build_component
from palestra.models.policy import CausalLMPolicy
from palestra.plugins.generators.kv_cache import KVCacheGenerator
from palestra.plugins.generators.static_kv import StaticKVGenerator
from palestra.plugins.policies.tiny import TinyTransformerPolicy
from palestra.types import Observation, SamplingParams

pytest.importorskip("transformers")

MODELS = ("llama", "qwen2")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-hf")
    return {"llama": tiny_hf.build_llama(root / "llama"), "qwen2": tiny_hf.build_qwen2(root / "qwen2")}


def build(path: Path, **options: object) -> CausalLMPolicy:
    policy = build_component("policy", {"name": "hf", "options": {"path": str(path), **options}}, path="policy")
    policy.eval()
    return policy


# Three prompts of different lengths (so rows are left-padded differently), each asked by a group of rows, one row
# capped at 3 tokens and one with a stop string: what a GRPO batch of a tool or dialogue environment looks like.
PROMPTS = ["What is 12 + 7? Put the answer in <answer></answer>.", "1+1=", "the quick brown fox"]


def observations(group: int = 3) -> list[Observation]:
    rows = [Observation(p) for p in PROMPTS for _ in range(group)]
    rows[1] = Observation(PROMPTS[0], max_new_tokens=3)
    rows[4] = Observation(PROMPTS[1], stop=["="])
    return rows


def both(policy: CausalLMPolicy, params: SamplingParams, obs: list[Observation], seed: int = 0, **static: object):
    ours = StaticKVGenerator(**static).generate(policy, obs, params, generator=torch.Generator().manual_seed(seed))
    theirs = KVCacheGenerator().generate(policy, obs, params, generator=torch.Generator().manual_seed(seed))
    return ours, theirs


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_outputs_equal_the_kv_cache_loop(folders: dict[str, Path], name: str, dtype: str) -> None:
    policy = build(folders[name], dtype=dtype)
    ours, theirs = both(policy, SamplingParams(max_new_tokens=12, temperature=0.0), observations())
    assert torch.equal(ours.completion_ids, theirs.completion_ids)
    assert torch.equal(ours.completion_mask, theirs.completion_mask)
    assert ours.texts == theirs.texts
    lengths = ours.completion_mask.sum(-1).tolist()
    assert lengths[1] <= 3 and max(lengths) > 3  # the cap held and the rows ran to different lengths
    if dtype == "float32":
        assert torch.allclose(ours.logprobs, theirs.logprobs, atol=1e-4)
        return
    # bf16 rounds these peaked logits (up to about 10) by up to 0.03, and either loop's log-probs stray from the
    # float32 model's by a few hundredths on average: the two must stray alike.
    exact = build(folders[name])
    with torch.no_grad():
        ref = exact.score(ours.prompt_ids, ours.prompt_mask, ours.completion_ids, ours.completion_mask).logprobs
    ref = ref * ours.completion_mask
    err_ours, err_theirs = (float((g.logprobs - ref).abs().mean()) for g in (ours, theirs))
    assert err_ours <= 1.5 * err_theirs + 0.01, (err_ours, err_theirs)


@pytest.mark.parametrize("name", MODELS)
def test_seeded_draws_are_kv_cache_draws_and_their_logprobs_match_a_recomputation(
    folders: dict[str, Path], name: str
) -> None:
    policy = build(folders[name])
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.95)
    ours, theirs = both(policy, params, observations(), seed=3)
    assert torch.equal(ours.completion_ids, theirs.completion_ids)
    assert torch.allclose(ours.logprobs, theirs.logprobs, atol=1e-4)
    with torch.no_grad():
        scored = policy.score(
            ours.prompt_ids, ours.prompt_mask, ours.completion_ids, ours.completion_mask, temperature=0.8
        ).logprobs
    assert torch.allclose(scored * ours.completion_mask, ours.logprobs, atol=1e-4)


def test_each_distinct_prompt_is_prefilled_once_unless_told_otherwise(folders: dict[str, Path]) -> None:
    policy = build(folders["llama"])
    prompt_ids, prompt_mask = policy.encode_observations(observations(group=4))
    counts = []
    for share in (True, False):
        steps = policy.static_steps(4, share_prompts=share)
        steps.prefill(prompt_ids, prompt_mask, (prompt_mask.long().cumsum(-1) - 1).clamp(min=0))
        counts.append(steps.prompt_rows)
    assert counts == [3, 12]
    ours, theirs = both(policy, SamplingParams(max_new_tokens=6), observations(), share_prompts=False)
    assert torch.equal(ours.completion_ids, theirs.completion_ids)


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def assert_follows(freq: torch.Tensor, probs: torch.Tensor, n: int) -> None:
    """Every token's frequency within 5 standard errors of its probability, and the total variation within what ``n``
    draws leave (its expectation is at most ``sum(sqrt(p (1 - p) / n)) / 2``; twice that is allowed)."""
    se = (probs * (1 - probs) / n).sqrt()
    worst = int(((freq - probs).abs() - 5 * se - 1e-3).argmax())
    assert (freq - probs).abs()[worst] <= 5 * se[worst] + 1e-3, (worst, float(freq[worst]), float(probs[worst]))
    tv = 0.5 * float((freq - probs).abs().sum())
    assert tv < float((probs * (1 - probs) / n).sqrt().sum()), tv


def test_many_draws_follow_the_models_distribution_at_the_prefill_and_at_a_decode_step(
    folders: dict[str, Path],
) -> None:
    policy = build(folders["llama"])
    n = 3000
    obs = [Observation("the quick brown")] * n
    params = SamplingParams(max_new_tokens=2, temperature=1.5)  # flatter than the peaked model: many tokens drawn
    out = StaticKVGenerator().generate(policy, obs, params, generator=torch.Generator().manual_seed(11))
    ids, mask = policy.encode_observations(obs[:1])
    with torch.no_grad():
        logits = policy.hf_model(input_ids=ids, attention_mask=mask.long()).logits[0, -1]
        first = torch.softmax(logits.double() / 1.5, -1)
    vocab = first.numel()
    assert int((first > 0.02).sum()) >= 3  # the test sees a real spread of tokens
    assert_follows(frequencies(out.completion_ids[:, 0], vocab), first, n)
    # The second token, for the rows whose first token was the most common one: a decode step over the cache.
    top = int(out.completion_ids[:, 0].mode().values)
    rows = (out.completion_ids[:, 0] == top) & out.completion_mask[:, 1]
    ids2 = torch.cat([ids, torch.tensor([[top]])], 1)
    with torch.no_grad():
        second = torch.softmax(policy.hf_model(input_ids=ids2).logits[0, -1].double() / 1.5, -1)
    assert int(rows.sum()) > 300
    assert_follows(frequencies(out.completion_ids[rows, 1], vocab), second, int(rows.sum()))


def test_a_policy_without_a_static_cache_is_named_once_and_sampled_as_kv_cache_does() -> None:
    tiny_policy = TinyTransformerPolicy(d_model=32, n_layers=2, n_heads=4, d_ff=64, seed=0, init_std=0.3)
    gen = StaticKVGenerator()
    obs = [Observation("1+1="), Observation("2+2=")]
    params = SamplingParams(max_new_tokens=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = gen.generate(tiny_policy, obs, params, generator=torch.Generator().manual_seed(0))
        gen.generate(tiny_policy, obs, params, generator=torch.Generator().manual_seed(0))
    lines = [str(w.message) for w in caught if "static_kv" in str(w.message)]
    assert len(lines) == 1 and "has no static KV cache" in lines[0]
    theirs = KVCacheGenerator().generate(tiny_policy, obs, params, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ours.completion_ids, theirs.completion_ids)


def test_a_bad_option_names_its_full_key() -> None:
    with pytest.raises(ConfigError, match=r"generator\.options\.compile"):
        build_component("generator", {"name": "static_kv", "options": {"compile": "yes"}}, path="generator")
    with pytest.raises(ConfigError, match=r"generator\.options"):
        build_component("generator", {"name": "static_kv", "options": {"warp": 9}}, path="generator")


def test_a_pooled_cache_is_reused_for_a_batch_of_its_shape_and_samples_as_a_fresh_one(folders: dict[str, Path]) -> None:
    from palestra.models.sampling import generate
    from palestra.plugins.policies._static_decode import CachePool

    policy, pool = build(folders["llama"]), CachePool(size=1)
    made: list[object] = []

    def stepper(n: int) -> object:
        made.append(policy.static_steps(n, caches=pool))
        return made[-1]

    params = SamplingParams(max_new_tokens=10, temperature=0.8)
    wide, narrow = observations(), observations(group=2)
    for seed, obs in ((1, wide), (2, wide), (3, narrow), (4, wide)):
        pooled = generate(policy, obs, params, generator=torch.Generator().manual_seed(seed), stepper=stepper)
        fresh = KVCacheGenerator().generate(policy, obs, params, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(pooled.completion_ids, fresh.completion_ids), seed  # the reused cache held nothing stale
        assert torch.allclose(pooled.logprobs, fresh.logprobs, atol=1e-4)
    keys = [m.cache.layers[0].keys for m in made]
    assert keys[1] is keys[0]  # the same shape: the same tensors, filled again from column 0
    assert keys[2] is not keys[0] and keys[3] is not keys[0]  # another shape evicted it from a pool of one


@pytest.mark.slow
def test_the_compiled_decode_step_gives_the_eager_steps_greedy_outputs(folders: dict[str, Path]) -> None:
    pytest.importorskip("torch._inductor")
    policy = build(folders["llama"])
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    compiled = StaticKVGenerator(compile=True)
    for prompts in (observations(), observations()[::-1]):  # the second batch reuses the first one's cache
        ours = compiled.generate(policy, prompts, params, generator=torch.Generator().manual_seed(0))
        theirs = KVCacheGenerator().generate(policy, prompts, params, generator=torch.Generator().manual_seed(0))
        assert torch.equal(ours.completion_ids, theirs.completion_ids)
        assert torch.allclose(ours.logprobs, theirs.logprobs, atol=1e-4)


def test_a_lora_policy_decodes_through_its_adapters(folders: dict[str, Path]) -> None:
    pytest.importorskip("peft")
    policy = build(folders["llama"], lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    with torch.no_grad():  # adapters that change the outputs: B starts at zero
        for name, weight in policy.named_parameters():
            if "lora_B" in name:
                weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    ours, theirs = both(policy, greedy, observations())
    assert torch.equal(ours.completion_ids, theirs.completion_ids)
    with policy.adapters_disabled():
        base, _ = both(policy, greedy, observations())
    assert not torch.equal(ours.completion_ids, base.completion_ids)
