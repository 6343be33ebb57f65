"""Workloads as the server receives them: shared prefixes, multi-turn history, trace sharing."""

from __future__ import annotations

import json
import os
from itertools import combinations, pairwise
from pathlib import Path

import pytest
from bench_helpers import run_sessions
from bench_stub import REPLY_WORDS
from tokenizers import Tokenizer

from shoal.bench.loadgen import LoadShape
from shoal.bench.metrics import input_token_check
from shoal.bench.trace import TraceEntry, TraceSynthesis, load_trace, trace_sessions
from shoal.bench.workloads import LengthDist, multi_turn, single_turn

REPO = Path(__file__).resolve().parents[2]
# the checkout's parent holds shared/ (../shared from the repository root)
MOONCAKE = Path(
    os.environ.get(
        "SHOAL_MOONCAKE_TRACE", REPO.parent / "shared/data/mooncake/conversation_trace.jsonl"
    )
)


@pytest.fixture(scope="module")
def tok(tokenizer_json) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_json))


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reply(n: int) -> str:
    """What the stub answers to max_tokens = n."""
    return "".join(" " + REPLY_WORDS[i % len(REPLY_WORDS)] for i in range(n))


def test_shared_prefix_groups_share_exactly_the_prefix(stub, vocab, builder, tok):
    sessions = single_turn(
        builder, 12, LengthDist.parse("50"), LengthDist.parse("3"), num_prefixes=3, prefix_len=20
    )
    result = run_sessions(stub.url, sessions, LoadShape("concurrency", concurrency=4), vocab)
    assert len(result.records) == 12 and all(r.ok for r in result.records)
    assert input_token_check(result.records)["mismatches"] == 0
    prompts = {s.turns[0].text: i for i, s in enumerate(sessions)}
    received = sorted((prompts[body["prompt"]], ids(tok, body["prompt"])) for body in stub.received)
    assert [i for i, _ in received] == list(range(12))
    for (i, a), (j, b) in combinations(received, 2):
        assert len(a) == len(b) == 50
        assert common_prefix(a, b) == (20 if i % 3 == j % 3 else 0)


def test_prefix_ratio_scales_with_each_prompt(builder, tok):
    sessions = single_turn(
        builder,
        8,
        LengthDist.parse("uniform:40:80"),
        LengthDist.parse("3"),
        num_prefixes=2,
        prefix_ratio=0.5,
    )
    encoded = [ids(tok, s.turns[0].text) for s in sessions]
    for i, a in enumerate(encoded):
        assert len(a) == sessions[i].turns[0].tokens
    for (i, a), (j, b) in combinations(enumerate(encoded), 2):
        shared = common_prefix(a, b)
        if i % 2 == j % 2:
            assert shared >= min(round(len(a) * 0.5), round(len(b) * 0.5))
        else:
            assert shared == 0


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_multi_turn_appends_each_answer(stub, vocab, builder, endpoint):
    sessions = multi_turn(
        builder,
        3,
        LengthDist.parse("3"),
        LengthDist.parse("uniform:5:9"),
        LengthDist.parse("4"),
        think_time_s=0.03,
    )
    result = run_sessions(
        stub.url,
        sessions,
        LoadShape("concurrency", concurrency=3),
        vocab,
        endpoint=endpoint,
        stub={"ttft_ms": 5, "itl_ms": 1, "hold_until": 3},
    )
    records = result.records
    assert len(records) == 9 and all(r.ok for r in records)
    assert stub.max_in_flight == 3
    check = input_token_check(records)
    assert check["checked"] == 9 and check["mismatches"] == 0
    by_session = {}
    for r in records:
        by_session.setdefault(r.session, []).append(r)
    for s in sessions:
        turns = sorted(by_session[s.id], key=lambda r: r.turn)
        assert [r.turn for r in turns] == [0, 1, 2]
        for prev, nxt in pairwise(turns):
            assert nxt.start_s - prev.end_s >= 0.03
            assert nxt.input_tokens > prev.input_tokens + 4
        # the history the server saw for the last turn: every turn and every answer
        texts = [t.text for t in s.turns]
        if endpoint == "chat":
            expected = []
            for t, text in enumerate(texts):
                expected.append({"role": "user", "content": text})
                if t < 2:
                    expected.append({"role": "assistant", "content": reply(4)})
            assert expected in [body["messages"] for body in stub.received]
            assert [r.messages for r in turns] == [1, 3, 5]
        else:
            expected = f"{texts[0]}{reply(4)} {texts[1]}{reply(4)} {texts[2]}"
            assert expected in [body["prompt"] for body in stub.received]
            assert turns[-1].input_tokens == vocab.count(expected)


HANDMADE = [
    {"timestamp": 0, "input_length": 1200, "output_length": 4, "hash_ids": [0, 1, 2]},
    {"timestamp": 50, "input_length": 1800, "output_length": 4, "hash_ids": [0, 3, 4, 5]},
    {"timestamp": 100, "input_length": 1300, "output_length": 4, "hash_ids": [0, 1, 6]},
    {"timestamp": 120, "input_length": 1024, "output_length": 4, "hash_ids": [0, 1]},
    {"timestamp": 150, "input_length": 300, "output_length": 4, "hash_ids": [7]},
    {"timestamp": 200, "input_length": 1500, "output_length": 4, "hash_ids": [0, 1, 2]},
]


def expected_shared(a: TraceEntry, b: TraceEntry, la: int, lb: int, block: int) -> int:
    """Tokens two synthesized prompts must share: their equal leading blocks, capped by length."""
    k = common_prefix(list(a.hash_ids), list(b.hash_ids))
    return min(k * block, la, lb)


def test_trace_replay_reproduces_block_sharing(stub, vocab, builder, tok, tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in HANDMADE))
    entries = load_trace(path)
    synthesis = TraceSynthesis(block_size=512, input_scale=1 / 32, speedup=2.0)
    assert synthesis.scaled_block == 16
    sessions = list(trace_sessions(entries, builder, synthesis))
    assert [s.arrival_s for s in sessions] == [0.0, 0.025, 0.05, 0.06, 0.075, 0.1]
    result = run_sessions(stub.url, sessions, LoadShape("replay"), vocab)
    records = sorted(result.records, key=lambda r: r.session)
    assert len(records) == 6 and all(r.ok for r in records)
    assert input_token_check(records)["mismatches"] == 0
    for r, s in zip(records, sessions, strict=True):
        assert 0 <= r.start_s - s.arrival_s < 0.05  # never early; late only on a busy machine
    by_text = {s.turns[0].text: s.id for s in sessions}
    prompts = {by_text[body["prompt"]]: ids(tok, body["prompt"]) for body in stub.received}
    lengths = [
        16 * (len(e.hash_ids) - 1) + round((e.input_length % 512 or 512) / 32) for e in entries
    ]
    assert [len(prompts[i]) for i in range(6)] == lengths
    for i, j in combinations(range(6), 2):
        shared = expected_shared(entries[i], entries[j], lengths[i], lengths[j], 16)
        assert common_prefix(prompts[i], prompts[j]) == shared, (i, j)
    assert common_prefix(prompts[0], prompts[5]) == lengths[0]  # same ids, longer last block


def test_trace_replay_jitter_spreads_shared_timestamps_in_order(builder, tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000 * (i // 10), "input_length": 600, "output_length": 4} for i in range(40)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    synthesis = TraceSynthesis(block_size=512, input_scale=1 / 32)
    plain = [s.arrival_s for s in trace_sessions(load_trace(path), builder, synthesis)]
    assert plain == [float(i // 10) for i in range(40)]  # ten at each instant
    spread = [s.arrival_s for s in trace_sessions(load_trace(path), builder, synthesis, 0.2, 3)]
    assert spread == sorted(spread)  # never before the request before it
    assert all(0 <= t - p < 0.2 for t, p in zip(spread, plain, strict=True))  # within its step
    assert len(set(spread)) == 40  # no two start at once
    again = [s.arrival_s for s in trace_sessions(load_trace(path), builder, synthesis, 0.2, 3)]
    assert again == spread  # seeded


def test_mooncake_trace_sharing_structure(builder, tok):
    if not MOONCAKE.exists():
        if os.environ.get("CI"):
            pytest.fail(f"Mooncake trace missing in CI: {MOONCAKE}")
        pytest.skip(f"Mooncake trace not present at {MOONCAKE}")
    entries = load_trace(MOONCAKE, block_size=512, limit=120)
    synthesis = TraceSynthesis(block_size=512, input_scale=1 / 32, output_scale=0.1)
    sessions = list(trace_sessions(entries, builder, synthesis))
    prompts = [ids(tok, s.turns[0].text) for s in sessions]
    width = builder.key_width
    assert sum(len(e.hash_ids) > 1 and e.hash_ids[0] == 0 for e in entries) > 50
    for s, p, e in zip(sessions, prompts, entries, strict=True):
        assert len(p) == s.turns[0].tokens == sum(n for _, _, n in synthesis.blocks(e, 0))
        assert s.turns[0].max_tokens == max(1, round(e.output_length * 0.1))
    for i, j in combinations(range(len(entries)), 2):
        a, b = prompts[i], prompts[j]
        low = expected_shared(entries[i], entries[j], len(a), len(b), 16)
        shared = common_prefix(a, b)
        # blocks with different ids diverge within their first key_width words
        assert low <= shared <= max(low, min(low + width - 1, len(a), len(b))), (i, j)


def test_trace_rejects_inconsistent_hash_ids(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 2000, "output_length": 5, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match="hash ids"):
        load_trace(path)


def test_trace_without_hash_ids_is_unique_content(builder, tok, tmp_path):
    path = tmp_path / "plain.jsonl"
    lines = [{"timestamp": t, "input_length": 40, "output_length": 3} for t in (0, 10, 20)]
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    sessions = list(trace_sessions(load_trace(path), builder, TraceSynthesis()))
    prompts = [ids(tok, s.turns[0].text) for s in sessions]
    assert [len(p) for p in prompts] == [40, 40, 40]
    assert all(common_prefix(a, b) == 0 for a, b in combinations(prompts, 2))
