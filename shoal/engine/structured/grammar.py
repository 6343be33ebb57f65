"""One sequence's grammar matcher: the tokens it accepted so far, and what it allows next."""

from __future__ import annotations

import xgrammar as xgr


class RequestGrammar:
    """A matcher over a compiled grammar for one sequence (n > 1 gives each its own)."""

    __slots__ = ("ahead", "failed", "matcher")

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: frozenset[int]) -> None:
        self.matcher = xgr.GrammarMatcher(
            compiled,
            override_stop_tokens=sorted(stop_token_ids),
            terminate_without_stop_token=not stop_token_ids,
        )
        self.failed = False  # a token outside the grammar was appended (cannot happen if masked)
        self.ahead = 0  # tokens taken by accept_ahead that the sequence has not appended yet

    def accept(self, token_id: int) -> None:
        """Advance past a token the sequence appends (unless accept_ahead took it already)."""
        if self.ahead:
            self.ahead -= 1
        elif not self.failed and not self.matcher.accept_token(token_id):
            self.failed = True

    def accept_ahead(self, token_id: int) -> None:
        """Advance past a token still being handed to the sequence (async scheduling: the
        next step's mask is needed before the previous step's outputs are processed)."""
        if not self.failed and not self.matcher.accept_token(token_id):
            self.failed = True
        self.ahead += 1

    def accept_all(self, token_ids: list[int]) -> None:
        """Advance past tokens generated before (a migrated request's earlier output)."""
        for token_id in token_ids:
            self.accept(token_id)

    @property
    def done(self) -> bool:
        """The grammar is complete (and its stop token taken, where it has one) or broken."""
        return self.failed or self.matcher.is_terminated()
