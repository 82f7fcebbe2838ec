"""Predicted Outputs: drafts from the text a client expects the output to be.

A request may carry a prediction (SamplingParams.prediction: token ids, OpenAI's `prediction`
field as the front-end tokenized it), e.g. the file an edit request will print back with a few
lines changed. Its drafts are the prediction's next tokens after the point the output has
reached in it:

- aligned: while each output token is the prediction's next one, a cursor follows the output
  along the prediction and the drafts are prediction[cursor : cursor + k];
- lost: an output token that differs (the model wrote something else) loses the alignment. It
  is found again by looking the output's last tokens up in the prediction, at or after where it
  was lost (at least REALIGN_MIN tokens must match, the longest of the first REALIGN_CANDIDATES
  occurrences wins, the nearest among equals), so a rewrite that keeps most of the text drafts
  the rest of it again;
- nothing found, or the prediction used up: prompt lookup over the request's own tokens
  (speculative.py's n-gram proposer).

The worker verifies these drafts as any others, so the output is what it would be without the
prediction (greedy: token for token; sampling: the same distribution). A request with a
prediction drafts even when the server has no --speculative-config; requests without one then
never draft (DraftTracker). Backing off is the n-gram proposer's: a request whose lookups find
nothing, or whose drafts are mostly rejected, decodes without drafts for a few steps.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from scheduler_svc.core.request import Request
from scheduler_svc.core.speculative import BACK_OFF_STEPS, MAX_MISSES, NgramProposer

REALIGN_MIN = 2  # output tokens that must match the prediction to find the alignment again
REALIGN_MAX = 8  # the longest match looked for (the output's last tokens)
REALIGN_CANDIDATES = 8  # occurrences of the last token tried, the nearest first


class _Alignment:
    """Where one request's output is in its prediction."""

    __slots__ = (
        "prediction",
        "cursor",
        "lost_at",
        "seen",
        "positions",
        "misses",
        "skip",
        "drafted",
        "accepted",
    )

    def __init__(self, prediction: Sequence[int]) -> None:
        self.prediction = prediction
        self.cursor: int | None = 0  # prediction index of the output's next token; None: lost
        self.lost_at = 0  # the cursor when it was lost: realignment looks from there on
        self.seen = 0  # output tokens followed so far
        self.positions: dict[int, list[int]] | None = None  # token -> its indices, on first use
        self.misses = 0  # proposals in a row that found nothing
        self.skip = 0  # steps left without drafting (backed off)
        self.drafted = 0.0  # decayed counts, as the n-gram proposer keeps them
        self.accepted = 0.0

    def follow(self, output: Sequence[int]) -> None:
        """Move the cursor along the output tokens not followed yet."""
        prediction, cursor = self.prediction, self.cursor
        end = len(prediction)
        for i in range(self.seen, len(output)):
            if cursor is None:
                break  # lost: realign() looks at the output's last tokens
            if cursor < end and prediction[cursor] == output[i]:
                cursor += 1
            else:
                self.lost_at, cursor = cursor, None
        self.cursor, self.seen = cursor, len(output)

    def realign(self, output: Sequence[int]) -> int | None:
        """The prediction index after the output's last tokens, at or after lost_at."""
        positions = self.positions
        if positions is None:
            positions = self.positions = {}
            for i, tok in enumerate(self.prediction):
                positions.setdefault(tok, []).append(i)
        if len(output) < REALIGN_MIN:
            return None
        found = positions.get(output[-1])
        if not found:
            return None
        prediction = self.prediction
        longest = min(REALIGN_MAX, len(output))
        best: int | None = None
        best_len = REALIGN_MIN - 1
        start = bisect_left(found, self.lost_at)
        for p in found[start : start + REALIGN_CANDIDATES]:
            m = 1
            while m < longest and m <= p and prediction[p - m] == output[-1 - m]:
                m += 1
            if m > best_len:
                best, best_len = p + 1, m
                if m == longest:
                    break
        return best

    def drafts(self, output: Sequence[int], max_tokens: int) -> list[int]:
        self.follow(output)
        if self.cursor is None:
            self.cursor = self.realign(output)
            if self.cursor is None:
                return []
        return list(self.prediction[self.cursor : self.cursor + max_tokens])


class PredictionProposer:
    """Drafts from a request's prediction; prompt lookup (`fallback`) for the rest. `everyone`:
    requests without a prediction draft by prompt lookup too (--speculative-config is set)."""

    def __init__(self, fallback: NgramProposer, everyone: bool) -> None:
        self.fallback = fallback
        self.everyone = everyone
        self.min_acceptance = fallback.config.min_acceptance
        self._aligned: dict[str, _Alignment] = {}

    def active(self, request: Request) -> bool:
        if not request.sampling_params.prediction:
            return self.everyone and self.fallback.active(request)
        state = self._aligned.get(request.request_id)
        return state is None or not state.skip

    def wants(self, request: Request) -> bool:
        if not request.sampling_params.prediction:
            return self.everyone and self.fallback.wants(request)
        state = self._aligned.get(request.request_id)
        if state is None or not state.skip:
            return True
        state.skip -= 1
        return False

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        prediction = request.sampling_params.prediction
        if not prediction:
            return self.fallback.propose(request, max_tokens)
        state = self._aligned.get(request.request_id)
        if state is None:
            state = self._aligned[request.request_id] = _Alignment(prediction)
        drafts = state.drafts(request.output_token_ids, max_tokens)
        if not drafts:
            drafts = self.fallback.propose(request, max_tokens)
        if drafts:
            state.misses = 0
            return drafts
        state.misses += 1
        state.skip = 1  # pipelined for its next step, as a prompt lookup that found nothing
        if state.misses >= MAX_MISSES:
            state.misses, state.skip = 0, BACK_OFF_STEPS
        return []

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        state = self._aligned.get(request.request_id)
        if state is None:
            self.fallback.record(request, num_drafted, num_accepted)
            return
        if not num_drafted:
            return
        state.drafted = 0.8 * state.drafted + num_drafted
        state.accepted = 0.8 * state.accepted + num_accepted
        if state.drafted >= 8 and state.accepted < self.min_acceptance * state.drafted:
            state.skip = BACK_OFF_STEPS  # the output went its own way; the text may come back
            state.drafted = state.accepted = 0.0

    def forget(self, request_id: str) -> None:
        self._aligned.pop(request_id, None)
        self.fallback.forget(request_id)
