"""Engine logprobs (TokenLogprob: chosen token first, then the top alternatives) in OpenAI's
chat and completions shapes."""

from __future__ import annotations

from shoal.frontend.tokenizer_pool import ModelTokenizer
from shoal.protocol import TokenLogprob


def chat_logprobs(tok: ModelTokenizer, logprobs: list[TokenLogprob]) -> list[dict]:
    """Entries of `choices[i].logprobs.content`: token, logprob, bytes and top_logprobs."""
    entries = []
    for lp in logprobs:
        text, raw = tok.piece(lp.token_ids[0])
        top = []
        for token_id, value in zip(lp.token_ids[1:], lp.logprobs[1:], strict=True):
            top_text, top_raw = tok.piece(token_id)
            top.append({"token": top_text, "logprob": value, "bytes": top_raw})
        entries.append(
            {"token": text, "logprob": lp.logprobs[0], "bytes": raw, "top_logprobs": top}
        )
    return entries


def empty_completion_logprobs() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


class CompletionLogprobs:
    """Builds the completions `logprobs` object of one choice, chunk by chunk.

    `text_offset` counts characters from the start of the choice's text (echoed prompt
    included), advancing by each token's text.
    """

    __slots__ = ("offset", "tok")

    def __init__(self, tok: ModelTokenizer) -> None:
        self.tok = tok
        self.offset = 0

    def add(self, token_ids: list[int], logprobs: list[TokenLogprob | None], out: dict) -> dict:
        """Append these tokens to `out` (from empty_completion_logprobs) and return it.

        A None entry (the first prompt token has no logprob) gives null logprobs.
        """
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            text = self.tok.piece(token_id)[0]
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(lp.logprobs[0])
            top: dict[str, float] = {}
            for top_id, value in zip(lp.token_ids, lp.logprobs, strict=True):
                top.setdefault(self.tok.piece(top_id)[0], value)
            out["top_logprobs"].append(top)
        return out
