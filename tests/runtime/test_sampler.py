"""The sampler's filters and penalties against HuggingFace's logits processors."""

from fractions import Fraction

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from runtime.sampler import apply_penalties, filter_logits, sample_tokens
from runtime.sampling_params import SamplingParams
from runtime.sequence import Sequence


def logits(seed=0, vocab=50):
    torch.manual_seed(seed)
    return torch.randn(vocab) * 3


def filtered(x, top_k=0, top_p=1.0, min_p=0.0):
    return filter_logits(x[None], torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))[0]


@pytest.mark.parametrize("k", [1, 5, 49])
def test_top_k_matches_hf(k):
    x = logits(k)
    expected = TopKLogitsWarper(k)(None, x[None].clone())[0]
    assert torch.equal(filtered(x, top_k=k), expected)


def test_top_k_keeps_the_tokens_tied_with_the_kth_as_hf():
    x = torch.tensor([3.0, 2.0, 2.0, 1.0, 2.0, 0.5])
    expected = TopKLogitsWarper(2)(None, x[None].clone())[0]
    assert torch.isinf(expected).tolist() == [False, False, False, True, False, True]
    assert torch.equal(filtered(x, top_k=2), expected)


def test_top_p_one_keeps_every_token():
    # The float32 running sum of these probabilities reaches 1 at the first token.
    assert not torch.isinf(filtered(torch.tensor([0.0, -20.0, -25.0]), top_p=1.0)).any()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.999])
def test_top_p_matches_hf(p):
    x = logits(int(p * 1000))
    expected = TopPLogitsWarper(p)(None, x[None].clone())[0]
    assert torch.equal(filtered(x, top_p=p), expected)


@pytest.mark.parametrize("min_p", [0.01, 0.2, 0.7])
def test_min_p_matches_hf(min_p):
    x = logits(3)
    expected = MinPLogitsWarper(min_p)(None, x[None].clone())[0]
    assert torch.equal(filtered(x, min_p=min_p), expected)


def generated(seq, tokens):
    """``seq`` after it generated ``tokens``."""
    seq.token_ids += tokens
    seq.output_token_ids += tokens


def test_repetition_penalty_matches_hf():
    x = logits(4)
    seq = Sequence(0, [3, 7, 7, 11], SamplingParams(repetition_penalty=1.3))
    generated(seq, [20, 3])
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seq.token_ids]), x[None].clone())[0]
    assert torch.allclose(apply_penalties(x.clone(), seq), expected, rtol=0, atol=1e-6)


def test_presence_and_frequency_penalties_count_output_only():
    x = logits(5)
    seq = Sequence(0, [1, 2], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    generated(seq, [4, 4, 9])
    out = apply_penalties(x.clone(), seq)
    expected = x.clone()
    expected[4] -= 0.5 + 2 * 0.25
    expected[9] -= 0.5 + 0.25
    assert torch.allclose(out, expected)
    assert out[1] == x[1]  # prompt tokens are not penalised


def test_greedy_with_penalty_avoids_the_repeated_token():
    x = torch.zeros(10)
    x[3], x[5] = 2.0, 1.9
    seq = Sequence(0, [3], SamplingParams(temperature=0.0, repetition_penalty=1.2))
    assert sample_tokens(x[None].clone(), [seq]).tolist() == [5]
    assert sample_tokens(x[None].clone(), [Sequence(1, [3], SamplingParams(temperature=0.0))]).tolist() == [3]


def seeded(params):
    seq = Sequence(0, [1], params)
    seq.seed_generator(torch.device("cpu"))
    return seq


def test_settings_apply_per_row():
    x = torch.stack([logits(7), logits(7)])
    out = filter_logits(x, torch.tensor([2, 0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]))
    assert (~torch.isinf(out[0])).sum() == 2 and not torch.isinf(out[1]).any()


def test_top_k_one_is_greedy_and_seed_fixes_draws():
    x = logits(6)
    draws = [sample_tokens(x[None].clone(), [seeded(SamplingParams(top_k=1, seed=s))]).tolist()[0] for s in range(5)]
    assert draws == [int(x.argmax())] * 5
    first, second = seeded(SamplingParams(seed=9)), seeded(SamplingParams(seed=9))
    a = [sample_tokens(x[None].clone(), [first]).tolist()[0] for _ in range(5)]
    b = [sample_tokens(x[None].clone(), [second]).tolist()[0] for _ in range(5)]
    assert a == b and len(set(a)) > 1


def test_seeded_draws_do_not_depend_on_the_batch():
    x = logits(8)
    alone, in_batch = seeded(SamplingParams(seed=3)), seeded(SamplingParams(seed=3))
    others = [seeded(SamplingParams(seed=s)) for s in (10, 11)] + [Sequence(5, [1], SamplingParams())]
    batch = torch.stack([logits(9), logits(10), logits(11), x])
    draws_alone = [sample_tokens(x[None].clone(), [alone]).item() for _ in range(12)]
    draws_in_batch = [sample_tokens(batch.clone(), others + [in_batch])[-1].item() for _ in range(12)]
    assert draws_in_batch == draws_alone and len(set(draws_alone)) > 1


def test_sampling_follows_the_distribution():
    x = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    seq = seeded(SamplingParams(seed=0))
    draws = [sample_tokens(x[None].clone(), [seq]).tolist()[0] for _ in range(4000)]
    counts = torch.bincount(torch.tensor(draws), minlength=3)
    assert torch.allclose(counts / 4000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                   "frequency_penalty"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_sampling_values_are_rejected(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be a finite number, got {value}$"):
        SamplingParams(**{field: value}).validate(50)


def test_real_values_a_tensor_cannot_take_are_held_as_floats_once_checked():
    # An int past int64 or a Fraction passes as a finite number; the sampler's tensors then take it as a float.
    params = SamplingParams(temperature=Fraction(1, 2), repetition_penalty=10**20, presence_penalty=Fraction(1, 2),
                            frequency_penalty=1, seed=0)
    params.validate(50)
    assert [type(getattr(params, name)) for name in ("temperature", "repetition_penalty", "presence_penalty",
                                                     "frequency_penalty")] == [float] * 4
    seq = seeded(params)
    generated(seq, [3, 4])
    assert sample_tokens(logits(13)[None].clone(), [seq]).item() not in (1, 3, 4)  # seen: sunk by the penalty


def test_sampling_values_are_checked_without_a_vocabulary():
    SamplingParams(stop_token_ids=[10**9]).validate()
    with pytest.raises(ValueError, match=r"top_k must be an integer >= 0"):
        SamplingParams(top_k=-1).validate()
    with pytest.raises(ValueError, match=r"stop_token_ids must be integers in \[0, 50\)"):
        SamplingParams(stop_token_ids=[50]).validate(50)


@pytest.mark.parametrize("temperature", [1e-38, 1e-300])
def test_a_tiny_temperature_samples_the_greedy_tokens(temperature):
    x = torch.stack([logits(seed) for seed in range(20)])
    x[:, 0] = -10.0  # no row's greedy token is 0, the token a NaN row would give
    seqs = [seeded(SamplingParams(temperature=temperature, seed=s)) for s in range(20)]
    assert sample_tokens(x.clone(), seqs).tolist() == x.argmax(-1).tolist()


@pytest.mark.parametrize("penalty", [1e-300, 1e300])
def test_an_extreme_repetition_penalty_leaves_the_logits_finite(penalty):
    x = logits(12)
    top, bottom = int(x.argmax()), int(x.argmin())
    seq = seeded(SamplingParams(repetition_penalty=penalty, seed=0))  # its prompt: token 1
    generated(seq, [top, bottom])
    penalised = apply_penalties(x.clone(), seq)
    assert torch.isfinite(penalised).all()
    unseen = torch.ones_like(x, dtype=torch.bool)
    unseen[[1, top, bottom]] = False
    assert torch.equal(penalised[unseen], x[unseen])
    largest = torch.finfo(torch.float32).max
    # 1e-300 lifts the seen token of positive logit as far as float32 goes and takes the negative one to 0;
    # 1e300 sinks the negative one as far as it goes and takes the positive one to 0.
    assert penalised[[top, bottom]].tolist() == ([largest, 0.0] if penalty < 1 else [0.0, -largest])
    draws = [sample_tokens(x[None].clone(), [seq]).item() for _ in range(20)]
    assert draws == [top] * 20 if penalty < 1 else bottom not in draws


def draw_frequencies(probs, params, draws=20000):
    """How often each token is drawn from logits log(``probs``) by ``draws`` seeded rows of ``params``
    (row i seeded i), the prompt [0] and no output."""
    x = torch.log(torch.tensor(probs)).expand(draws, -1).clone()
    seqs = [seeded(SamplingParams(**params, seed=i)) for i in range(draws)]
    for seq in seqs:
        seq.token_ids = [0]
    return torch.bincount(sample_tokens(x, seqs), minlength=len(probs)) / draws


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_draws_follow_the_softmax_of_the_logits_over_the_temperature(temperature):
    # 20000 draws: each frequency is within 0.015 (over 4 standard deviations) of softmax(x / T);
    # T = 1 would give [0.6, 0.3, 0.1], far outside it at either temperature.
    x = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    frequencies = draw_frequencies([0.6, 0.3, 0.1], dict(temperature=temperature))
    assert torch.allclose(frequencies, (x / temperature).softmax(-1), rtol=0, atol=0.015)


def test_a_drawn_row_is_drawn_from_its_penalised_logits():
    # A repetition penalty of 2 on the prompt's token 0 doubles its negative logit: probabilities
    # 0.5, 0.3, 0.2 become 0.25, 0.3, 0.2 renormalised (1/3, 0.4, 4/15). A frequency penalty of
    # log 2 on an output token 2 seen once halves its probability: 0.5, 0.3, 0.1 renormalised.
    expected = torch.tensor([0.25, 0.3, 0.2]) / 0.75
    frequencies = draw_frequencies([0.5, 0.3, 0.2], dict(temperature=1.0, repetition_penalty=2.0))
    assert torch.allclose(frequencies, expected, rtol=0, atol=0.015)
    draws = 20000
    x = torch.log(torch.tensor([0.5, 0.3, 0.2])).expand(draws, -1).clone()
    seqs = [seeded(SamplingParams(temperature=1.0, frequency_penalty=torch.log(torch.tensor(2.0)).item(), seed=i))
            for i in range(draws)]
    for seq in seqs:
        generated(seq, [2])
    frequencies = torch.bincount(sample_tokens(x, seqs), minlength=3) / draws
    assert torch.allclose(frequencies, torch.tensor([0.5, 0.3, 0.1]) / 0.9, rtol=0, atol=0.015)


@pytest.mark.parametrize("setting, allowed", [(dict(top_p=0.7), {0, 1}), (dict(min_p=0.25), {0, 1, 2}),
                                              (dict(min_p=0.25, temperature=2.0), {0, 1, 2, 3})])
def test_sample_tokens_draws_only_inside_the_top_p_and_min_p_sets(setting, allowed):
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps {0, 1} (0.5 falls short of it, 0.8 crosses
    # it); min_p 0.25 keeps those of at least 0.125, {0, 1, 2}. At temperature 2 the filters see the
    # tempered probabilities, as HF's warpers do: 0.05 becomes 0.12 beside 0.38 at the top, past
    # 0.25 x 0.38, so all four are kept. 1000 seeded draws fall inside the set and draw each of its tokens.
    draws = 1000
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).expand(draws, -1).clone()
    seqs = [seeded(SamplingParams(seed=i, **{"temperature": 1.0, **setting})) for i in range(draws)]
    assert set(sample_tokens(x, seqs).tolist()) == allowed
