"""Sampler: seeds, filtering sets, penalties, logprobs, stop conditions and n > 1."""

import pytest
import torch
from helpers import assert_no_leaks, greedy, hf_model, random_prompts, token_ids

from shoal import LLM, SamplingParams
from shoal.engine.request import Request
from shoal.engine.sampler import Sampler, filtered_probs

PROMPTS = random_prompts([9, 30, 17], seed=20)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir))


def sampled(llm, prompts, **kw):
    return token_ids(llm, prompts, SamplingParams(max_tokens=12, ignore_eos=True, **kw))


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    alone = sampled(llm, [PROMPTS[0]], temperature=1.0, seed=7)
    again = sampled(llm, [PROMPTS[0]], temperature=1.0, seed=7)
    batch = token_ids(
        llm,
        PROMPTS,
        [
            SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=7),
            SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.7),
            SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.3, seed=3),
        ],
    )
    assert alone == again == batch[:1]
    assert sampled(llm, [PROMPTS[0]], temperature=1.0, seed=8) != alone


def test_engine_seed_makes_unseeded_runs_repeat(llama_dir):
    a = sampled(LLM(str(llama_dir), seed=5), PROMPTS, temperature=1.0)
    b = sampled(LLM(str(llama_dir), seed=5), PROMPTS, temperature=1.0)
    assert a == b


def test_filters_never_leave_their_allowed_set():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    probs = filtered_probs(
        logits.repeat(1, 1),
        temperature=torch.tensor([1.0, 0.8, 1.2]),
        top_k=[5, 0, 0],
        top_p=[1.0, 0.6, 1.0],
        min_p=[0.0, 0.0, 0.2],
    )
    top5 = set(logits[0].topk(5).indices.tolist())
    sorted_p, order = (logits[1] / 0.8).softmax(-1).sort(descending=True)
    nucleus = set(order[: int((sorted_p.cumsum(0) < 0.6).sum()) + 1].tolist())
    p2 = (logits[2] / 1.2).softmax(-1)
    min_p_set = set((p2 >= 0.2 * p2.max()).nonzero().flatten().tolist())
    for row, allowed in enumerate([top5, nucleus, min_p_set]):
        assert set(probs[row].nonzero().flatten().tolist()) == allowed
        draws = torch.multinomial(probs[row], 2000, replacement=True)
        assert set(draws.tolist()) <= allowed


def test_engine_top_k_draws_stay_in_top_k(llm, llama_dir):
    prompt = PROMPTS[1]
    with torch.no_grad():
        logits = hf_model(llama_dir)(torch.tensor([prompt])).logits[0, -1]
    allowed = set(logits.topk(3).indices.tolist())
    params = [
        SamplingParams(max_tokens=1, temperature=2.0, top_k=3, seed=s, ignore_eos=True)
        for s in range(60)
    ]
    firsts = {ids[0] for ids in token_ids(llm, [prompt] * 60, params)}
    assert firsts <= allowed and len(firsts) > 1


def test_logprobs_match_transformers(llm, llama_dir):
    prompt = PROMPTS[0]
    out = llm.generate([prompt], greedy(4, logprobs=3, prompt_logprobs=2))[0]
    seq = out.outputs[0]
    full = torch.tensor([prompt + seq.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(llama_dir)(full).logits[0].float(), -1)
    for step, lp in enumerate(seq.logprobs):
        pos = len(prompt) - 1 + step
        assert lp.token_ids[0] == seq.token_ids[step] and lp.ranks[0] == 1
        assert lp.token_ids[1:] == ref[pos].topk(3).indices.tolist()
        assert lp.logprobs[0] == pytest.approx(ref[pos, seq.token_ids[step]].item(), abs=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos, lp in enumerate(out.prompt_logprobs[1:]):
        assert lp.token_ids[0] == prompt[pos + 1]
        assert lp.logprobs[0] == pytest.approx(ref[pos, prompt[pos + 1]].item(), abs=1e-4)
        assert lp.ranks[0] == int((ref[pos] > ref[pos, prompt[pos + 1]]).sum()) + 1


def test_penalties_change_greedy_choice(llm):
    base = token_ids(llm, [PROMPTS[0]], greedy(24))[0]
    repeated = max(set(base), key=base.count)
    assert base.count(repeated) > 1, "the fixture model should repeat itself greedily"
    for kw in ({"repetition_penalty": 5.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        out = token_ids(llm, [PROMPTS[0]], greedy(24, **kw))[0]
        assert out != base
        assert len(set(out)) >= len(set(base))


def penalised(logits: list[float], prompt: list[int], outputs: list[int], **penalties):
    """The sampler's penalised logits and greedy choice for one request with this history."""
    sp = SamplingParams(temperature=0.0, **penalties)
    req = Request("r", prompt, sp, frozenset(), 16)
    for token in outputs:
        req.append_token(token)
    sampler = Sampler()
    row = torch.tensor([logits])
    adjusted = sampler._apply_penalties(row.clone(), [req])[0].tolist()
    return adjusted, sampler(row, [req]).token_ids.item()


# vocab of 6; prompt tokens 1, 2; output tokens 4, 4, 3
LOGITS, PROMPT, OUTPUTS = [2.0, 1.5, -1.0, 0.5, 3.0, 0.0], [1, 2], [4, 4, 3]


def test_penalties_by_hand():
    # vLLM's definitions. repetition_penalty r on every token seen in the prompt or the
    # output: a positive logit is divided by r, a negative one multiplied by r. Then, on
    # output tokens only: logit -= frequency_penalty * count + presence_penalty * (count > 0).
    adjusted, chosen = penalised(LOGITS, PROMPT, OUTPUTS, repetition_penalty=2.0)
    # 1: 1.5 / 2; 2: -1.0 * 2; 3: 0.5 / 2; 4: 3.0 / 2; 0 and 5 unseen
    assert adjusted == [2.0, 0.75, -2.0, 0.25, 1.5, 0.0]
    assert chosen == 0
    adjusted, chosen = penalised(LOGITS, PROMPT, OUTPUTS, frequency_penalty=1.0)
    # 4 twice: 3.0 - 2; 3 once: 0.5 - 1; prompt tokens untouched
    assert adjusted == [2.0, 1.5, -1.0, -0.5, 1.0, 0.0]
    assert chosen == 0
    adjusted, chosen = penalised(LOGITS, PROMPT, OUTPUTS, presence_penalty=0.5)
    # 4: 3.0 - 0.5; 3: 0.5 - 0.5
    assert adjusted == [2.0, 1.5, -1.0, 0.0, 2.5, 0.0]
    assert chosen == 4
    adjusted, chosen = penalised(
        LOGITS,
        PROMPT,
        OUTPUTS,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=1.0,
    )
    # repetition first, then 4: 1.5 - (0.5 * 2 + 1.0); 3: 0.25 - (0.5 * 1 + 1.0)
    assert adjusted == [2.0, 0.75, -2.0, -1.25, -0.5, 0.0]
    assert chosen == 0


def test_stop_token_ids_min_tokens_and_eos(llm):
    base = token_ids(llm, [PROMPTS[2]], greedy(20))[0]
    stop_at = base[5]
    first = base.index(stop_at)
    out = llm.generate([PROMPTS[2]], greedy(20, stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == base[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    late = llm.generate([PROMPTS[2]], greedy(20, stop_token_ids=[stop_at], min_tokens=first + 2))
    assert stop_at not in late[0].outputs[0].token_ids[: first + 2]
    eos = llm.engine.model_config.eos_token_ids[0]
    no_eos = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[], min_tokens=20)
    assert eos not in token_ids(llm, [PROMPTS[2]], no_eos)[0]


def test_n_samples_share_prompt_blocks(llm):
    prompt = random_prompts([40], seed=21)[0]
    hits = llm.engine.kv.stats.hits
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    # the two later samples reuse the leader's two full prompt blocks of 16 tokens
    assert llm.engine.kv.stats.hits - hits == 2 * 32
    single = [
        token_ids(llm, [prompt], SamplingParams(temperature=1.0, seed=1 + i, max_tokens=8))[0]
        for i in range(3)
    ]
    assert [o.token_ids for o in out.outputs] == single
    assert_no_leaks(llm)
