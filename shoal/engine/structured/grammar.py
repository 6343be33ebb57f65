"""One sequence's grammar matcher: the tokens it accepted so far, and what it allows next."""

from __future__ import annotations

import xgrammar as xgr


class RequestGrammar:
    """A matcher over a compiled grammar for one sequence (n > 1 gives each its own).

    `done` is kept as a plain flag, updated by each accept, so reading it never touches the
    matcher while a mask is being filled from it on another thread.
    """

    __slots__ = ("ahead", "done", "failed", "matcher")

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: frozenset[int]) -> None:
        self.matcher = xgr.GrammarMatcher(
            compiled,
            override_stop_tokens=sorted(stop_token_ids),
            terminate_without_stop_token=not stop_token_ids,
        )
        self.failed = False  # a token outside the grammar was appended (cannot happen if masked)
        self.done = False  # complete (and its stop token taken, where it has one) or broken
        self.ahead = 0  # tokens taken by accept_ahead that the sequence has not appended yet

    def accept(self, token_id: int) -> None:
        """Advance past a token the sequence appends (unless accept_ahead took it already)."""
        if self.ahead:
            self.ahead -= 1
        else:
            self._advance(token_id)

    def accept_ahead(self, token_id: int) -> None:
        """Advance past a token still being handed to the sequence (async scheduling: the
        next step's mask is needed before the previous step's outputs are processed)."""
        self._advance(token_id)
        self.ahead += 1

    def accept_all(self, token_ids: list[int]) -> None:
        """Advance past tokens generated before (a migrated request's earlier output)."""
        for token_id in token_ids:
            self.accept(token_id)

    def _advance(self, token_id: int) -> None:
        if not self.failed and not self.matcher.accept_token(token_id):
            self.failed = True
        self.done = self.failed or self.matcher.is_terminated()
