"""``zoo::route_topk``: the Triton router kernel (``ops_cuda/router_triton.py``) against the op's PyTorch
reference, in Triton's interpreter on CPU tensors and on the GPU: every option of ``layers.TopKRouter``
(softmax or sigmoid, correction bias, group-limited top-k scored by the best expert or the two best,
renormalisation with or without a floor under the sum, scaling), expert counts that are not powers of two,
DeepSeek-V3's, Qwen3's and ERNIE 4.5's routers.
A token's ids may come out in another order than the reference's: both are sorted by id to compare.
"""

import pytest
import torch

from ops_cuda.router import route_topk, route_topk_reference

# name -> (experts, route_topk options after the logits and bias)
CASES = {
    "qwen3": (128, dict(top_k=8, scoring="softmax", renormalize=True, num_groups=1, topk_groups=1,
                        group_score="top2_sum", scaling_factor=1.0)),
    "mixtral_not_renormalised": (8, dict(top_k=2, scoring="softmax", renormalize=False, num_groups=1, topk_groups=1,
                                         group_score="top2_sum", scaling_factor=1.0)),
    "qwen2_moe_60_experts": (60, dict(top_k=4, scoring="softmax", renormalize=False, num_groups=1, topk_groups=1,
                                      group_score="top2_sum", scaling_factor=1.0)),
    "deepseek_v3": (256, dict(top_k=8, scoring="sigmoid", renormalize=True, num_groups=8, topk_groups=4,
                              group_score="top2_sum", scaling_factor=2.5)),
    "deepseek_v2_group_max": (160, dict(top_k=6, scoring="softmax", renormalize=False, num_groups=8, topk_groups=3,
                                        group_score="max", scaling_factor=16.0)),
    "sigmoid_no_groups": (24, dict(top_k=3, scoring="sigmoid", renormalize=False, num_groups=1, topk_groups=1,
                                   group_score="top2_sum", scaling_factor=1.0)),
    "three_groups_of_six": (18, dict(top_k=5, scoring="sigmoid", renormalize=True, num_groups=3, topk_groups=2,
                                     group_score="top2_sum", scaling_factor=1.0)),
}
BIASED = {"deepseek_v3", "three_groups_of_six", "softmax_biased", "ernie4_5_floor"}
CASES["softmax_biased"] = (32, dict(CASES["qwen3"][1], top_k=4))
# ERNIE 4.5's router, its floor under the renormalising sum high enough to bite on some tokens
CASES["ernie4_5_floor"] = (64, dict(CASES["qwen3"][1], top_k=6, renormalize_min=0.1))


def routing_inputs(case, num_tokens, device="cpu", dtype=torch.float32, seed=0):
    num_experts, options = CASES[case]
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bfloat16:  # random bf16 logits tie often: a shuffled grid of values bf16 holds exactly
        grid = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(num_tokens)])
        logits = ((grid - num_experts // 2) / 16).to(device=device, dtype=dtype)
    else:
        logits = (torch.randn(num_tokens, num_experts, generator=g) * 2).to(device=device, dtype=dtype)
    bias = (torch.randn(num_experts, generator=g) * 0.5).to(device) if case in BIASED else None
    if options["scoring"] != "softmax" or bias is not None or options["num_groups"] > 1:  # as TopKRouter does
        logits = logits.float()
    return logits, bias, options


def sorted_by_id(weights, ids):
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def check(ours, reference):
    (weights, ids), (ref_weights, ref_ids) = sorted_by_id(*ours), sorted_by_id(*reference)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == ref_ids.shape
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    torch.testing.assert_close(weights.cpu(), ref_weights.cpu(), rtol=2e-6, atol=1e-7)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_interpreted(case):
    from ops_cuda.router_triton import route_topk_triton

    logits, bias, options = routing_inputs(case, 5)
    check(route_topk_triton(logits, bias, **options), route_topk_reference(logits, bias, **options))


@pytest.mark.interpreter
def test_half_logits_strided_and_no_tokens_interpreted():
    from ops_cuda.router_triton import route_topk_triton

    logits, bias, options = routing_inputs("qwen3", 3, dtype=torch.float16)
    strided = torch.cat([logits, logits], dim=1)[:, 128:]
    check(route_topk_triton(strided, bias, **options), route_topk_reference(logits, bias, **options))
    weights, ids = route_topk_triton(logits[:0], bias, **options)
    assert weights.shape == ids.shape == (0, 8)


@pytest.mark.interpreter
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_equal_choices_go_to_the_lower_ids_interpreted(bias):
    from ops_cuda.router_triton import route_topk_triton

    logits = torch.full((1, 16), -1.0)
    logits[0, [12, 3, 9, 7]] = 2.0
    correction = torch.zeros(16) if bias else None
    options = dict(top_k=3, scoring="sigmoid", renormalize=False, num_groups=1, topk_groups=1,
                   group_score="top2_sum", scaling_factor=1.0)
    weights, ids = route_topk_triton(logits, correction, **options)
    assert ids.tolist() == [[3, 7, 9]]
    assert torch.equal(weights, torch.full((1, 3), 2.0).sigmoid())


@pytest.mark.interpreter
def test_the_floor_of_the_renormalising_sum_interpreted():
    """ERNIE 4.5's moe_norm_min: a token whose chosen experts' probabilities sum below it (one expert's
    logit 60 ahead, a correction bias that passes it over) has them divided by the floor, not the sum."""
    from ops_cuda.router_triton import route_topk_triton

    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    logits[:2, 0] = 60.0
    bias = torch.zeros(16)
    bias[0] = -2.0
    options = dict(top_k=2, scoring="softmax", renormalize=True, num_groups=1, topk_groups=1,
                   group_score="top2_sum", scaling_factor=1.0, renormalize_min=1e-12)
    weights, ids = route_topk_triton(logits, bias, **options)
    check((weights, ids), route_topk_reference(logits, bias, **options))
    chosen = logits.softmax(-1).gather(1, ids)
    torch.testing.assert_close(weights[:2], chosen[:2] / 1e-12)
    torch.testing.assert_close(weights[2:], chosen[2:] / chosen[2:].sum(-1, keepdim=True))


def test_groups_limit_the_choice():
    """DeepSeek-V3's choice on hand-made scores: the best experts sit in groups that lose to groups of two
    good experts, so the top-k comes from those groups only."""
    logits = torch.full((1, 8), -4.0)
    logits[0, [0, 1]] = 1.0  # group 0: two good experts
    logits[0, [4, 5]] = torch.tensor([0.9, 0.8])  # group 2: two good experts
    logits[0, 2] = 3.0  # group 1: the best expert, alone
    options = dict(top_k=3, scoring="sigmoid", renormalize=False, num_groups=4, topk_groups=2,
                   group_score="top2_sum", scaling_factor=1.0)
    weights, ids = sorted_by_id(*route_topk(logits, None, **options))
    assert ids.tolist() == [[0, 1, 4]]
    torch.testing.assert_close(weights, logits[:, [0, 1, 4]].sigmoid())
    _, by_max = route_topk(logits, None, **dict(options, group_score="max"))
    assert 2 in by_max.tolist()[0]  # scored by its best expert, group 1 wins


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 300])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_gpu(case, tokens):
    logits, bias, options = routing_inputs(case, tokens, device="cuda", dtype=torch.bfloat16, seed=tokens)
    check(route_topk(logits, bias, **options), route_topk_reference(logits, bias, **options))


@pytest.mark.gpu
def test_fake_kernel_and_captured_graph_gpu():
    """Captured once, replayed over the captured logits, then over new logits (and, once, a new
    correction bias) written into the same buffers: each replay routes as the reference does on the
    values it read; a graph that kept its captured values fails after the first."""
    logits, bias, options = routing_inputs("deepseek_v3", 16, device="cuda")
    args = (logits, bias, *options.values())
    torch.library.opcheck(torch.ops.zoo.route_topk.default, args, test_utils=("test_schema", "test_faketensor"))
    route_topk(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = route_topk(*args)
    captured_ids = None
    for seed in range(4):
        if seed:  # new values in the captured buffers
            new_logits, new_bias, _ = routing_inputs("deepseek_v3", 16, device="cuda", seed=seed)
            logits.copy_(new_logits)
            if seed == 3:
                bias.copy_(new_bias)
        weights.fill_(float("nan"))
        ids.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        check((weights, ids), route_topk_reference(logits, bias, **options))
        if captured_ids is None:
            captured_ids = ids.sort(dim=-1).values.clone()
    assert not torch.equal(ids.sort(dim=-1).values, captured_ids)
