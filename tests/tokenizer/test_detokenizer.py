"""IncrementalDetokenizer on long outputs: the same text as one decode, stop strings found
however far in, and only the unreleased text kept between calls."""

import pytest

from shoal.tokenizer import IncrementalDetokenizer, TextTokenizer

SENTENCE = "The river ran past the mill, 鱼群在水中一起游动。 Numbers 12345 and words; "


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> TextTokenizer:
    return TextTokenizer(tokenizer_dir)


def stream(detok: IncrementalDetokenizer, ids: list[int], per_call: int) -> list[str]:
    """Feed ids `per_call` at a time (the last call final); check what is kept after each."""
    pieces = []
    for start in range(0, len(ids), per_call):
        final = start + per_call >= len(ids)
        pieces.append(detok.add_tokens(ids[start : start + per_call], final=final))
        assert len(detok.pending) <= detok.holdback
        if detok.stop_reason is not None:
            break
    return pieces


@pytest.mark.parametrize("stop", [[], ["never appears"]])  # no holdback, or one
@pytest.mark.parametrize("per_call", [1, 7])
def test_long_output_streams_the_whole_text(tok, per_call, stop):
    text = SENTENCE * 400
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 10_000
    detok = IncrementalDetokenizer(tok.tokenizer, stop=stop)
    pieces = stream(detok, ids, per_call)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text
    assert detok.stop_reason is None


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("per_call", [1, 5])
def test_stop_string_at_the_end_of_a_long_output(tok, include, per_call):
    stop = "STOP here"
    text = SENTENCE * 300 + "last words STOP here and after " + SENTENCE
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(
        tok.tokenizer, stop=["xyz never", stop], include_stop_str_in_output=include
    )
    out = "".join(stream(detok, ids, per_call))
    end = text.index(stop) + (len(stop) if include else 0)
    assert out == text[:end]
    assert detok.stop_reason == stop
    assert detok.add_tokens(ids[:3], final=True) == ""


def test_earliest_stop_string_wins_and_held_text_is_released_at_the_end(tok):
    ids = tok.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok.tokenizer, stop=["four", "two"])
    assert "".join(stream(detok, ids, 1)) == "one "
    assert detok.stop_reason == "two"
    held = IncrementalDetokenizer(tok.tokenizer, stop=["three four five"])
    released = [held.add_tokens([t]) for t in ids]
    assert held.pending and "".join(released) + held.pending == "one two three four"
    assert "".join(released) + held.add_tokens([], final=True) == "one two three four"
