"""palestra.models.sampling and the ``kv_cache`` generator, driving the real ``tiny`` policy."""

from __future__ import annotations

import math

import pytest
import torch

from palestra.models.sampling import generate, pick_tokens, sample
from palestra.plugins.generators.kv_cache import KVCacheGenerator
from palestra.plugins.policies.tiny import TinyTransformerPolicy
from palestra.types import Generation, Observation, SamplingParams

PROMPTS = ["1 + 2 = ?", "34 * 5 =", "7", "12 - 9 + 40 = ?", "?", "0 0 0"]


@pytest.fixture(scope="module")
def policy() -> TinyTransformerPolicy:
    # init_std 0.3 (not the default 0.02): the policy is far from uniform, so greedy ties do not happen and
    # sampled and greedy completions differ visibly.
    return TinyTransformerPolicy(d_model=32, n_layers=2, n_heads=4, d_ff=64, seed=0, init_std=0.3)


def observations(prompts=PROMPTS, stop=None) -> list[Observation]:
    return [Observation(prompt=p, stop=stop) for p in prompts]


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_conventions(
    gen: Generation, policy: TinyTransformerPolicy, params: SamplingParams, stops=None, caps=None
) -> list[str]:
    """Every completion convention of GYM.md, row by row; returns how each row ended.

    ``caps[i]`` is row ``i``'s own length cap (None: ``params.max_new_tokens``)."""
    tok = policy.tokenizer
    b, t = gen.completion_ids.shape
    assert gen.completion_mask.shape == gen.logprobs.shape == (b, t) and len(gen.texts) == b
    assert gen.completion_ids.dtype == torch.int64 and gen.completion_mask.dtype == torch.bool
    assert gen.logprobs.dtype == torch.float32
    assert t <= params.max_new_tokens
    lengths = gen.completion_mask.sum(-1)
    assert t == 0 or int(lengths.max()) == t  # T is the longest completion
    end_ids = {tok.eos_token_id, *params.stop_token_ids}
    endings = []
    for i in range(b):
        n = int(lengths[i])
        assert gen.completion_mask[i, :n].all() and not gen.completion_mask[i, n:].any()  # right-padded
        assert (gen.completion_ids[i, n:] == tok.pad_token_id).all()
        assert (gen.logprobs[i, n:] == 0).all() and (gen.logprobs[i, :n] <= 0).all()
        ids = gen.completion_ids[i, :n].tolist()
        assert not end_ids & set(ids[:-1])  # an end token ends the row at once
        row_stops = list(params.stop) + list((stops or {}).get(i, []))
        for k in range(1, n):
            assert not any(s in tok.decode(ids[:k]) for s in row_stops), "generation ran past a stop string"
        if ids and ids[-1] in end_ids:
            assert gen.texts[i] == tok.decode(ids[:-1])  # the EOS / stop token is not text
            endings.append("eos")
        else:
            assert gen.texts[i] == tok.decode(ids)
            if any(s in gen.texts[i] for s in row_stops):
                endings.append("stop")  # the stop string is in the text
            else:
                cap = params.max_new_tokens if caps is None or caps[i] is None else min(caps[i], params.max_new_tokens)
                assert n == cap
                endings.append("length")
    return endings


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_behaviour_logprobs_equal_policy_scores(policy, temperature, top_p):
    params = SamplingParams(max_new_tokens=10, temperature=temperature, top_p=top_p)
    gen = generate(policy, observations(), params, generator=seeded(1))
    check_conventions(gen, policy, params)
    scores = policy.score(
        gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask, temperature=temperature
    )
    torch.testing.assert_close(gen.logprobs, scores.logprobs.detach(), rtol=0, atol=1e-5)


def test_greedy_is_deterministic_scores_at_temperature_one_and_ignores_padding(policy):
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    a = generate(policy, observations(), params, generator=seeded(1))
    b = generate(policy, observations(), params, generator=seeded(2))
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts
    scores = policy.score(a.prompt_ids, a.prompt_mask, a.completion_ids, a.completion_mask, temperature=1.0)
    torch.testing.assert_close(a.logprobs, scores.logprobs.detach(), rtol=0, atol=1e-5)
    # Each row alone (no left padding, no other rows finishing early) decodes the same tokens.
    for i, prompt in enumerate(PROMPTS):
        alone = generate(policy, observations([prompt]), params)
        n = int(a.completion_mask[i].sum())
        assert alone.texts == [a.texts[i]]
        assert alone.completion_ids[0, :n].tolist() == a.completion_ids[i, :n].tolist()
        torch.testing.assert_close(alone.logprobs[0, :n], a.logprobs[i, :n], rtol=0, atol=1e-5)
    # A nucleus too small for a second token is greedy.
    nucleus = generate(policy, observations(), SamplingParams(max_new_tokens=8, top_p=1e-6), generator=seeded(3))
    assert torch.equal(nucleus.completion_ids, a.completion_ids)


def test_same_seed_same_samples_and_different_seeds_differ(policy):
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    a = generate(policy, observations() * 4, params, generator=seeded(7))
    b = generate(policy, observations() * 4, params, generator=seeded(7))
    c = generate(policy, observations() * 4, params, generator=seeded(8))
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert a.texts != c.texts
    torch.manual_seed(3)
    d = generate(policy, observations() * 4, params)  # no generator: torch's global RNG
    torch.manual_seed(3)
    assert generate(policy, observations() * 4, params).texts == d.texts


def test_eos_stop_tokens_and_length_end_rows_per_the_conventions(policy):
    tok = policy.tokenizer
    params = SamplingParams(max_new_tokens=12, temperature=1.5)
    gen = generate(policy, observations() * 8, params, generator=seeded(4))
    endings = check_conventions(gen, policy, params)
    assert "eos" in endings and "length" in endings  # both kinds happen with this seed
    # An extra stop token id ends rows like EOS: kept in the ids and mask, not in the text.
    digit = tok.token_to_id("1")
    params = SamplingParams(max_new_tokens=12, temperature=1.5, stop_token_ids=[digit])
    gen = generate(policy, observations() * 8, params, generator=seeded(4))
    endings = check_conventions(gen, policy, params)
    lengths = gen.completion_mask.sum(-1)
    ended_by_digit = [i for i in range(len(endings)) if gen.completion_ids[i, int(lengths[i]) - 1] == digit]
    assert ended_by_digit and all(endings[i] == "eos" and "1" not in gen.texts[i] for i in ended_by_digit)


def test_stop_strings_from_params_and_observations(policy):
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    free = generate(policy, observations(), greedy)
    # Pick, per row, a two-character piece of its own greedy text, and stop on it through the observation.
    tok = policy.tokenizer
    stops, expected_length = {}, {}
    for i, text in enumerate(free.texts):
        if len(text) >= 4:
            stops[i] = [text[2:4]]
            ids = free.completion_ids[i].tolist()
            # Greedy decoding is deterministic: the row must end at the first token whose text completes the stop.
            expected_length[i] = next(k for k in range(1, len(ids) + 1) if text[2:4] in tok.decode(ids[:k]))
    assert len(stops) >= 3, free.texts
    obs = [Observation(prompt=p, stop=stops.get(i)) for i, p in enumerate(PROMPTS)]
    gen = generate(policy, obs, greedy)
    endings = check_conventions(gen, policy, greedy, stops)
    for i in range(len(PROMPTS)):
        n = int(gen.completion_mask[i].sum())
        assert gen.completion_ids[i, :n].tolist() == free.completion_ids[i, :n].tolist()
        if i in stops:
            assert endings[i] == "stop" and n == expected_length[i] and stops[i][0] in gen.texts[i]
        else:
            assert gen.texts[i] == free.texts[i]
    # Stop strings for every row go in the sampling parameters; sample() takes token ids directly.
    first = free.texts[0][:2]
    ids, mask = policy.encode_observations(observations())
    by_params = sample(policy, ids, mask, SamplingParams(max_new_tokens=12, temperature=0.0, stop=[first]))
    ids0 = free.completion_ids[0].tolist()
    n0 = next(k for k in range(1, len(ids0) + 1) if first in tok.decode(ids0[:k]))
    assert by_params.completion_ids[0].tolist()[:n0] == ids0[:n0] and int(by_params.completion_mask[0].sum()) == n0
    assert by_params.texts[0] == tok.decode(ids0[:n0]) and by_params.texts[0].startswith(first)
    check_conventions(by_params, policy, SamplingParams(max_new_tokens=12, stop=[first]))


def test_max_new_tokens_bounds_the_completion(policy):
    one = generate(policy, observations(), SamplingParams(max_new_tokens=1), generator=seeded(0))
    assert one.completion_ids.shape == (len(PROMPTS), 1) and one.completion_mask.all()
    none = generate(policy, observations(), SamplingParams(max_new_tokens=0))
    assert none.completion_ids.shape == (len(PROMPTS), 0) and none.texts == [""] * len(PROMPTS)


CAPS = [1, 3, None, 0, 2, 20]


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_per_row_caps_truncate_rows_and_keep_logprobs_consistent(policy, temperature):
    params = SamplingParams(max_new_tokens=8, temperature=temperature)
    prompts = PROMPTS * 3
    caps = CAPS * 3
    obs = [Observation(prompt=p, max_new_tokens=c) for p, c in zip(prompts, caps)]
    gen = generate(policy, obs, params, generator=seeded(11))
    endings = check_conventions(gen, policy, params, caps=caps)
    lengths = gen.completion_mask.sum(-1).tolist()
    for n, c in zip(lengths, caps):
        assert n <= (8 if c is None else min(c, 8))
    assert "length" in endings and lengths[3] == 0 and gen.texts[3] == ""
    # The behaviour log-probs are what score() gives for the produced tokens (0 where masked).
    scores = policy.score(
        gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask, temperature=temperature or 1.0
    )
    torch.testing.assert_close(gen.logprobs, scores.logprobs.detach(), rtol=0, atol=1e-5)
    # A cap only truncates: each row's tokens are the uncapped row's first ones (same seed, same draws).
    free = generate(policy, [Observation(prompt=p) for p in prompts], params, generator=seeded(11))
    for i, n in enumerate(lengths):
        assert gen.completion_ids[i, :n].tolist() == free.completion_ids[i, :n].tolist()
        torch.testing.assert_close(gen.logprobs[i, :n], free.logprobs[i, :n], rtol=0, atol=1e-5)
        if caps[i] is None or caps[i] >= 8:
            assert gen.texts[i] == free.texts[i]


def test_caps_of_none_or_above_the_limit_change_nothing(policy):
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    base = generate(policy, observations(), params, generator=seeded(2))
    for cap in (None, 10, 50):
        obs = [Observation(prompt=p, max_new_tokens=cap) for p in PROMPTS]
        gen = generate(policy, obs, params, generator=seeded(2))
        assert gen.texts == base.texts and torch.equal(gen.completion_ids, base.completion_ids)
        assert torch.equal(gen.completion_mask, base.completion_mask) and torch.equal(gen.logprobs, base.logprobs)
    # Every row capped: the loop stops at the largest cap; sample() takes the caps directly.
    ids, mask = policy.encode_observations(observations())
    short = sample(policy, ids, mask, params, max_new_tokens=[2] * len(PROMPTS), generator=seeded(2))
    assert short.completion_ids.shape[1] <= 2
    zero = sample(policy, ids, mask, params, max_new_tokens=[0] * len(PROMPTS))
    assert zero.completion_ids.shape == (len(PROMPTS), 0) and zero.texts == [""] * len(PROMPTS)


def test_kv_cache_generator_honours_observation_caps(policy):
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    obs = [Observation(prompt=p, max_new_tokens=c) for p, c in zip(PROMPTS, CAPS)]
    a = KVCacheGenerator().generate(policy, obs, params, generator=seeded(5))
    b = generate(policy, obs, params, generator=seeded(5))
    assert a.texts == b.texts and torch.equal(a.completion_mask, b.completion_mask)
    check_conventions(a, policy, params, caps=CAPS)


def test_pick_tokens_never_draws_outside_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]] * 4000))
    token, logp = pick_tokens(logits, 1.0, 0.8, seeded(0))
    counts = torch.bincount(token, minlength=5)
    assert counts[2:].sum() == 0 and counts[0] > counts[1] > 0  # {0, 1} reach 0.8; token 4 has probability 0
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1))
    token, _ = pick_tokens(logits, 1.0, 1.0, seeded(0))
    counts = torch.bincount(token, minlength=5).double() / 4000
    assert counts[4] == 0 and (counts[:4] - torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.double)).abs().max() < 0.04


def test_id_order_draws_of_large_vocabularies_follow_the_tempered_softmax_and_skip_impossible_tokens():
    # top_p == 1 with more than SORTED_DRAW_MAX_VOCAB tokens draws by inverse-CDF in id order: tokens of probability
    # 0 sit before, between and after the possible ones (in other blocks and the same block), and the
    # temperature reshapes the distribution.
    from palestra.models.sampling import SORTED_DRAW_MAX_VOCAB

    row = torch.full((SORTED_DRAW_MAX_VOCAB + 344,), -math.inf)
    row[[3, 250, 257, 599]] = torch.tensor([1.0, 0.0, 2.0, -1.0])
    logits = row.repeat(20000, 1)
    for temperature in (1.0, 0.5, 2.0):
        token, logp = pick_tokens(logits, temperature, 1.0, seeded(3))
        expected = torch.softmax(row / temperature, -1).double()
        freq = torch.bincount(token, minlength=len(row)).double() / len(token)
        assert freq[expected == 0].sum() == 0
        assert (freq - expected).abs().max() < 0.015, (temperature, freq[freq > 0], expected[expected > 0])  # > 4 s.e.
        torch.testing.assert_close(
            logp, torch.log_softmax(logits / temperature, -1).gather(-1, token[:, None]).squeeze(-1)
        )


@pytest.mark.parametrize("vocab", [8, 3000])  # one block, and many blocks (some without any mass)
def test_draws_in_id_order_pick_the_id_where_the_running_mass_passes_u_and_never_an_impossible_one(vocab):
    from palestra.models.sampling import _draw_in_id_order

    probs = torch.zeros(vocab)
    ids = [1, 3, 6] if vocab == 8 else [5, 700, 701, 2900]  # impossible ids before, between and after
    probs[ids] = torch.tensor([0.2, 0.5, 0.3] if vocab == 8 else [0.1, 0.4, 0.2, 0.3])
    rows = probs.repeat(4, 1)
    edges = torch.tensor([[0.0], [0.3], [0.75], [1.0]])  # u = 1 lands on the total itself: the last possible id
    drawn = _draw_in_id_order(rows, edges).squeeze(-1).tolist()
    assert drawn == ([1, 3, 6, 6] if vocab == 8 else [5, 700, 2900, 2900])
    u = torch.rand((20000, 1), generator=seeded(4))
    freq = torch.bincount(_draw_in_id_order(probs.repeat(20000, 1), u).squeeze(-1), minlength=vocab).double() / 20000
    assert freq[probs == 0].sum() == 0 and (freq - probs.double()).abs().max() < 0.015


def test_stop_strings_decode_each_token_id_alone_at_most_once(policy):
    class Counting:
        """The policy's tokenizer, counting decode calls by length (a stand-in only for the count)."""

        def __init__(self, tok):
            self.tok, self.calls = tok, 0
            self.pad_token_id, self.eos_token_id = tok.pad_token_id, tok.eos_token_id

        def decode(self, ids):
            self.calls += 1
            return self.tok.decode(ids)

    from palestra.models.sampling import _StopStrings

    counting = Counting(policy.tokenizer)
    watch = _StopStrings(counting, [["zz"], ["zz"], ["zz"]])
    a, b = policy.tokenizer.encode("12")
    for step in range(10):
        assert watch.update([(a, b)[step % 2]] * 3, [False] * 3) == []
    # each of the two token ids decoded alone once (its text length), then one tail per row and step (the tails of
    # single-character tokens are long enough at once); decoding the new token alone per row and step would be 60
    assert counting.calls == 2 + 3 * 10


def test_bad_inputs_are_one_line_errors_naming_the_culprit(policy):
    obs = observations()
    for params, culprit in [
        (SamplingParams(top_p=0.0), "SamplingParams.top_p"),
        (SamplingParams(temperature=-1.0), "SamplingParams.temperature"),
        (SamplingParams(max_new_tokens=-2), "SamplingParams.max_new_tokens"),
        (SamplingParams(stop=[""]), r"SamplingParams.stop\[0\]"),
        (SamplingParams(max_new_tokens=300), r"policy.options.max_len: a prompt of \d+ tokens \+ max_new_tokens=300"),
    ]:
        with pytest.raises(ValueError, match=culprit) as info:
            generate(policy, obs, params)
        assert "\n" not in str(info.value)
    ids, mask = policy.encode_observations(obs)
    with pytest.raises(ValueError, match="prompt_mask"):
        sample(policy, ids, mask.long(), SamplingParams())
    with pytest.raises(ValueError, match="stops: expected one list per row"):
        sample(policy, ids, mask, SamplingParams(), stops=[["x"]])
    with pytest.raises(ValueError, match="max_new_tokens: expected one cap"):
        sample(policy, ids, mask, SamplingParams(), max_new_tokens=[1])
    with pytest.raises(ValueError, match=r"max_new_tokens\[0\]: expected an integer >= 0 or None"):
        sample(policy, ids, mask, SamplingParams(), max_new_tokens=[-1] * len(obs))
    with pytest.raises(ValueError, match=r"observations\[1\].max_new_tokens"):
        generate(policy, [Observation(prompt="1"), Observation(prompt="2", max_new_tokens=1.5)], SamplingParams())
    with pytest.raises(ValueError, match="observations is empty"):
        generate(policy, [], SamplingParams())


def test_kv_cache_generator_plugin_samples_like_generate(policy):
    params = SamplingParams(max_new_tokens=6, temperature=0.9, stop=["</answer>"])
    a = KVCacheGenerator().generate(policy, observations(), params, generator=seeded(5))
    b = generate(policy, observations(), params, generator=seeded(5))
    assert a.texts == b.texts and torch.equal(a.completion_ids, b.completion_ids)
