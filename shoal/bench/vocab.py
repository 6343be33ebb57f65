"""Words that are one token each wherever they stand, so prompts have exact token counts."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Without a tokenizer, prompts are made of these words and counted one token per word.
FALLBACK_TEXT = (
    "about after again air all also an and any are as at back be been before being below "
    "between both but by call can city come could day did do does down each end even every "
    "few find first for from get give go good great had has have he her here him his how if "
    "in into is it its just keep kind know land large last leave left life light like line "
    "little long look made make man many may more most move much must name near need never "
    "new next no not now number of off old on once one only open or other our out over own "
    "part people place play point put read right river run said same say see she should show "
    "side small so some sound still stop such take tell than that the their them then there "
    "these they thing think this those three through time to too tree try turn two under up "
    "us use very want was water way we well went were what when where which while who why "
    "will with word work world would write year you young your"
)

MIN_WORDS = 16


@dataclass(frozen=True)
class Vocabulary:
    """Prompt words (each one token, first or after a space) and the client-side token counter."""

    words: tuple[str, ...]
    count: Callable[[str], int]
    exact: bool
    source: str


def load_vocabulary(tokenizer: str | Path | None) -> Vocabulary:
    """Words from a local tokenizer.json (file or directory), or English words without one."""
    if tokenizer is None:
        return Vocabulary(
            tuple(FALLBACK_TEXT.split()),
            lambda text: len(text.split()),
            False,
            "words (no tokenizer)",
        )
    from tokenizers import Tokenizer

    path = Path(tokenizer)
    if path.is_dir():
        path = path / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    return Vocabulary(_single_token_words(tok), count, True, str(path))


def _single_token_words(tok) -> tuple[str, ...]:
    """ASCII words that encode to one token alone and one more token after a space."""
    candidates = sorted(
        {w for t in tok.get_vocab() if (w := t.lstrip("Ġ▁")).isascii() and w.isalpha()}
    )
    pairs = tok.encode_batch([f"{w} {w}" for w in candidates], add_special_tokens=False)
    words = tuple(w for w, enc in zip(candidates, pairs, strict=True) if len(enc.ids) == 2)
    if len(words) < MIN_WORDS:
        raise ValueError(f"tokenizer has only {len(words)} single-token words (need {MIN_WORDS})")
    sample = random.Random(0).choices(range(len(words)), k=4 * len(words))
    text = " ".join(words[i] for i in sample)
    if len(tok.encode(text, add_special_tokens=False).ids) != len(sample):
        raise ValueError("tokenizer merges words across spaces; prompts cannot be token-exact")
    return words
