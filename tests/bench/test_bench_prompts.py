"""Prompt words are one token each, blocks are deterministic and distinct, lengths parse."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer

from shoal.bench.prompts import TAPE_WORDS, PromptBuilder
from shoal.bench.vocab import load_vocabulary
from shoal.bench.workloads import LengthDist, single_turn


@pytest.fixture(scope="module")
def tok(tokenizer_json) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_json))


def test_words_are_single_tokens_alone_and_after_a_space(vocab, tok):
    assert len(vocab.words) >= 16 and vocab.exact
    for word in vocab.words:
        assert len(tok.encode(word, add_special_tokens=False).ids) == 1
        assert len(tok.encode(f"{word} {word}", add_special_tokens=False).ids) == 2


def test_tokenizer_directory_or_file(tokenizer_dir, tokenizer_json):
    assert load_vocabulary(tokenizer_dir).words == load_vocabulary(tokenizer_json).words


@pytest.mark.parametrize("n", [1, 2, 7, 8, 100, 1537])
def test_prompt_has_exact_token_count(builder, tok, n):
    text = builder.text([("request", builder.new_key("request"), n)])
    assert len(tok.encode(text, add_special_tokens=False).ids) == n
    assert builder.vocab.count(text) == n


def test_blocks_concatenate_exactly(builder, tok):
    blocks = [("prefix", 3, 40), ("request", 9, 25), ("request", 10, 1)]
    text = builder.text(blocks)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) == 66
    first = tok.encode(builder.text(blocks[:1]), add_special_tokens=False).ids
    assert ids[:40] == first


def test_blocks_are_deterministic_prefix_consistent_and_keyed(vocab):
    a, b = PromptBuilder(vocab, seed=1), PromptBuilder(vocab, seed=1)
    assert a.block_text("x", 5, 50) == b.block_text("x", 5, 50)
    assert a.block_text("x", 5, 50).split()[:13] == a.block_text("x", 5, 13).split()
    assert a.block_text("x", 5, 50) != PromptBuilder(vocab, seed=2).block_text("x", 5, 50)
    assert a.block_text("x", 5, 50) != a.block_text("y", 5, 50)
    base = len(vocab.words)
    # keys that differ modulo the word count differ at the first word
    firsts = {a.block_text("x", k, 20).split()[0] for k in range(base)}
    assert len(firsts) == base
    # keys below base ** key_width differ within the key digits
    w = a.key_width
    assert a.block_text("x", 3, w) != a.block_text("x", 3 + base**2, w)
    assert a.block_text("x", 3, w).split()[0] == a.block_text("x", 3 + base**2, w).split()[0]


def test_blocks_longer_than_the_word_tape(builder):
    n = TAPE_WORDS + 1000
    text = builder.block_text("request", 7, n)
    assert len(text.split(" ")) == n  # single spaces only: one token per word


def test_new_keys_never_repeat(builder):
    keys = [builder.new_key("request") for _ in range(5)]
    assert keys == [0, 1, 2, 3, 4]
    assert builder.new_key("prefix") == 0


def test_workload_prompts_differ_from_the_first_token(builder, tok):
    sessions = single_turn(builder, 20, LengthDist.parse("30"), LengthDist.parse("4"))
    firsts = {tok.encode(s.turns[0].text, add_special_tokens=False).ids[0] for s in sessions}
    assert len(firsts) == 20


def test_fallback_words_without_tokenizer():
    vocab = load_vocabulary(None)
    assert not vocab.exact
    builder = PromptBuilder(vocab)
    text = builder.text([("request", 0, 123)])
    assert vocab.count(text) == 123 == len(text.split())


@pytest.mark.parametrize(
    ("spec", "lo", "hi"),
    [("64", 64, 64), ("uniform:10:20", 10, 20), ("normal:100:30", 1, None)],
)
def test_length_distributions(spec, lo, hi):
    dist = LengthDist.parse(spec)
    values = dist.sample(np.random.default_rng(0), 5000)
    assert values.min() >= lo and (hi is None or values.max() <= hi)
    if dist.kind == "uniform":
        assert set(values.tolist()) == set(range(10, 21))
    if dist.kind == "normal":
        assert values.mean() == pytest.approx(100, abs=2)
        assert values.std() == pytest.approx(30, abs=2)
    assert str(LengthDist.parse(str(dist))) == str(dist)


@pytest.mark.parametrize("spec", ["", "0", "abc", "uniform:5", "uniform:9:3", "gamma:1:2", "-3"])
def test_bad_length_specs(spec):
    with pytest.raises(ValueError):
        LengthDist.parse(spec)
