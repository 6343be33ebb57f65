"""Grammar-constrained decoding in the engine, on the tiny random Llama.

The model's weights are random, so output that parses and conforms in every one of
hundreds of sampled requests comes from the grammar mask alone.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar as xgr
from schema_check import violations

from shoal import LLM, SamplingParams
from shoal.engine.structured import apply_token_bitmask
from shoal.protocol import StructuredOutputsParams

SCHEMAS = [
    {  # nested objects, enums, numbers
        "type": "object",
        "properties": {
            "u": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99},
                    "r": {"enum": ["ad", "gu"]},
                },
                "required": ["id", "r"],
            },
            "s": {"type": "boolean"},
        },
        "required": ["u", "s"],
    },
    {  # bounded arrays of bounded strings, booleans
        "type": "object",
        "properties": {
            "t": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
            "ok": {"type": "boolean"},
        },
        "required": ["t", "ok"],
    },
    {  # a top-level array of small objects
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "k": {"enum": ["x", "y"]},
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["k", "v"],
        },
        "minItems": 1,
        "maxItems": 2,
    },
    {
        "type": "object",
        "properties": {"n": {"type": "string", "minLength": 1, "maxLength": 4}},
        "required": ["n"],
    },
]
PROMPTS = [[5 + i % 300, 17, 42, 9 + i % 7] for i in range(24)]


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), device="cpu", num_gpu_blocks=2048, max_num_seqs=256)


def constrained(schema, **kw) -> SamplingParams:
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=kw.pop("compact", True))
    return SamplingParams(max_tokens=kw.pop("max_tokens", 64), structured_outputs=so, **kw)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_sampled_json_conforms_every_time(llm, index):
    schema = SCHEMAS[index]
    params = [
        constrained(schema, temperature=1.0, seed=1000 * index + i) for i in range(len(PROMPTS))
    ]
    outs = llm.generate(PROMPTS, params)
    for out in outs:
        seq = out.outputs[0]
        assert seq.finish_reason == "stop", seq.text
        assert violations(json.loads(seq.text), schema) == [], seq.text


def test_greedy_and_whitespace_tolerant_json_conforms(llm):
    schema = SCHEMAS[0]
    greedy = llm.generate(PROMPTS[:4], constrained(schema, temperature=0.0))
    loose = llm.generate(
        PROMPTS[:4], constrained(schema, temperature=0.7, seed=5, compact=False, max_tokens=160)
    )
    for out in greedy + loose:
        seq = out.outputs[0]
        assert seq.finish_reason == "stop", seq.text
        assert violations(json.loads(seq.text), schema) == []
    # json_object: any JSON object
    outs = llm.generate(
        PROMPTS[:4],
        SamplingParams(
            temperature=1.0,
            seed=2,
            max_tokens=96,
            structured_outputs=StructuredOutputsParams(
                json_object=True, disable_any_whitespace=True
            ),
        ),
    )
    parsed = [json.loads(o.outputs[0].text) for o in outs if o.outputs[0].finish_reason == "stop"]
    assert parsed and all(isinstance(p, dict) for p in parsed)


def test_regex_choice_and_grammar(llm):
    regex = r"[a-z]{2,4}-\d{3}"
    so = StructuredOutputsParams(regex=regex)
    outs = llm.generate(
        PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=16, structured_outputs=so)
    )
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outs), [
        o.outputs[0].text for o in outs
    ]
    choices = ["red", "green", "dark blue"]
    so = StructuredOutputsParams(choice=choices)
    outs = llm.generate(
        PROMPTS, SamplingParams(temperature=1.0, n=2, seed=4, max_tokens=16, structured_outputs=so)
    )
    texts = [c.text for o in outs for c in o.outputs]
    assert set(texts) <= set(choices) and len(set(texts)) > 1
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    so = StructuredOutputsParams(grammar=grammar)
    outs = llm.generate(
        PROMPTS[:16], SamplingParams(temperature=1.0, seed=6, max_tokens=40, structured_outputs=so)
    )
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", o.outputs[0].text)
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 8


def test_unconstrained_rows_unchanged_in_a_mixed_batch(llm):
    plain = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=12, max_tokens=12, ignore_eos=True),
    ]
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], plain)]
    mixed_params = plain + [constrained(SCHEMAS[i % 4], temperature=1.0, seed=i) for i in range(8)]
    mixed = llm.generate(PROMPTS[:3] + PROMPTS[3:11], mixed_params)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for o, i in zip(mixed[3:], range(8), strict=True):
        assert violations(json.loads(o.outputs[0].text), SCHEMAS[i % 4]) == []


def test_constrained_greedy_is_the_masked_argmax(llm):
    """Greedy under a choice grammar picks, among the allowed first tokens, the one the
    unconstrained model scores highest: the mask removes tokens and changes nothing else."""
    prompt = PROMPTS[0]
    lp = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=20))
    ranked = lp[0].outputs[0].logprobs[0].token_ids[1:]
    choices = [llm.tokenizer.decode([t]) for t in ranked[5:8]]
    choices = [c for c in choices if c.strip()]
    so = StructuredOutputsParams(choice=choices)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=so)
    )
    assert out[0].outputs[0].text == choices[0]


def test_async_scheduling_preemption_and_chunked_prefill(llama_dir, llm):
    """Seeded constrained requests give the same tokens with async scheduling, under
    preemption (a KV pool too small for the batch) and with prompts prefilled in chunks."""
    params = [constrained(SCHEMAS[i % 4], temperature=1.0, seed=50 + i) for i in range(8)]
    prompts = [p * 5 for p in PROMPTS[:8]]  # 20-token prompts
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    tight = LLM(
        str(llama_dir),
        device="cpu",
        num_gpu_blocks=12,
        async_scheduling=True,
        max_num_batched_tokens=32,
    )
    got = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == expected


def test_invalid_grammar_raises_and_keeps_the_engine(llm):
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a(b"))
    good = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="parenthesis"):
        llm.generate(PROMPTS[:2], [bad, good])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    outs = llm.generate(PROMPTS[:2], [good, good])
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


def test_abort_while_compiling(llm):
    from shoal.protocol import EngineRequest

    so = StructuredOutputsParams(json={"type": "object", "properties": {"zz": {"type": "integer"}}})
    engine = llm.engine
    engine.add_request(
        EngineRequest(
            request_id="abort-me",
            prompt_token_ids=[5, 6],
            sampling=SamplingParams(n=2, structured_outputs=so),
        )
    )
    engine.abort("abort-me")
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def test_torch_mask_matches_xgrammar_kernel():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 100, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 4), generator=gen, dtype=torch.int64).to(
        torch.int32
    )
    ours, theirs = logits.clone(), logits.clone()
    apply_token_bitmask(ours, bitmask)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=100)
    assert torch.equal(ours.isinf(), theirs.isinf())
    assert torch.equal(ours[~ours.isinf()], logits[~ours.isinf()])
    assert 0 < int(ours.isinf().sum()) < ours.numel()


def test_async_scheduling_keeps_constrained_steps_in_flight(llama_dir):
    """A constrained batch stays pipelined: each step returns with the next one launched
    (the grammar takes its pending token when the next mask is built), and the output
    still follows the schema."""
    from shoal.protocol import EngineRequest

    pipelined = LLM(str(llama_dir), device="cpu", async_scheduling=True)
    engine = pipelined.engine
    sp = constrained(SCHEMAS[0], temperature=1.0, seed=7)
    engine.add_request(EngineRequest(request_id="r", prompt_token_ids=[5, 6, 7], sampling=sp))
    tokens, in_flight, finish = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            finish = out.finish_reason or finish
        in_flight.append(engine._in_flight is not None)
    assert len(in_flight) > 10 and all(in_flight[:-2])  # every step but the draining ones
    assert finish == "stop"
    assert violations(json.loads(pipelined.tokenizer.decode(tokens)), SCHEMAS[0]) == []


def test_serial_and_threaded_fills_mask_the_same(llm):
    """The mask fills on one thread for small batches and on xgrammar's threads from
    THREADED_FROM rows: both give the same masked logits, for matchers in varied states."""
    from shoal.engine.structured import GrammarMask, RequestGrammar

    compiled = llm.engine._grammar_pool().submit(constrained(SCHEMAS[2]).structured_outputs)
    vocab = llm.engine.model_config.vocab_size
    stops = frozenset(llm.engine.eos_token_ids)
    grammars = [RequestGrammar(compiled.result(), stops) for _ in range(6)]
    probe = torch.zeros(1, vocab)
    for i, g in enumerate(grammars):  # walk each a different number of allowed tokens
        for _ in range(i):
            row = probe.clone()
            GrammarMask(1).apply(row, [0], [g])
            allowed = row[0].isfinite().nonzero().flatten().tolist()
            g.accept(next(t for t in allowed if t not in stops))
    logits = torch.randn(len(grammars) + 2, vocab, generator=torch.Generator().manual_seed(3))
    rows = list(range(1, len(grammars) + 1))
    serial, threaded = logits.clone(), logits.clone()
    GrammarMask(2, threaded_from=len(rows) + 1).apply(serial, rows, grammars)
    GrammarMask(2, threaded_from=1).apply(threaded, rows, grammars)
    assert torch.equal(serial, threaded)
    assert torch.equal(serial[[0, -1]], logits[[0, -1]])  # unconstrained rows untouched
    masked = serial[1:-1].isinf().sum(dim=1)
    assert bool((masked > 0).all()) and len(set(masked.tolist())) > 1  # varied states
