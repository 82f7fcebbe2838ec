"""How many drafted tokens a step takes: as many as raise the worker's tokens per second.

At a small batch a step's time is reading the weights, and scoring a few more tokens in the
same pass costs almost nothing; past some width the step turns to arithmetic and each token
costs its share. The worker measures where, when it starts (worker_svc/cost_probe.py): the
seconds of a step of 1, 2, 4, ... tokens. With `rows` requests decoding, D drafts buy about
`acceptance * D` more tokens, and a step that verifies waits for its drafting requests' last
tokens (no pipelining): `gap_s`, the worker's measured wait before such steps. So a step takes
the D in [0, most] that maximises

    (rows + acceptance * D) / (t(rows + D) + (gap_s if D else 0))

t linear between the measured widths and along the last segment past them. `acceptance` is the
share of drafted tokens kept, decayed so that it follows what the requests do now. Drafts must
promise MIN_GAIN over no drafts: the curve is one short request's, and a real step's attention
over many contexts makes a wide step dearer than it says.

    budget = DraftBudget(step_s=[0.011, 0.011, 0.012, 0.013, 0.018, 0.03, 0.055])
    budget.best(rows=1, most=6)       # 6: all of them
    budget.best(rows=64, most=384)    # 0: the step is arithmetic already
    budget.verified(drafted=6, accepted=2)
"""

from __future__ import annotations

from collections.abc import Sequence

# the acceptance before any verification: one step's worth of drafts, half of them kept
PRIOR_DRAFTED, PRIOR_ACCEPTED = 8.0, 4.0
DECAY = 0.95  # per verification: the estimate follows about the last 20
MAX_CANDIDATES = 64  # draft counts tried per step (evenly spaced when there are more)
MIN_GAIN = 1.1  # tokens per second drafts must promise over none (docs/speculative.md)


class DraftBudget:
    def __init__(self, step_s: Sequence[float]) -> None:
        if not step_s or any(t <= 0 for t in step_s):
            raise ValueError("step_s: positive seconds of steps of 1, 2, 4, ... tokens")
        self.step_s = [float(t) for t in step_s]
        self.drafted, self.accepted = PRIOR_DRAFTED, PRIOR_ACCEPTED
        self.gap_s = 0.0
        # (rows, most) -> best: valid until acceptance or gap change, i.e. until a step
        # verifies drafts; a wide batch that drafts nothing keeps asking the same question
        self._best: dict[tuple[int, int], int] = {}

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted

    def step_time(self, tokens: int) -> float:
        """Seconds of a step of `tokens` tokens, from the measured widths 1, 2, 4, ..."""
        ts = self.step_s
        if len(ts) == 1:
            return ts[0] * max(tokens, 1)
        if tokens <= 1:
            return ts[0]
        i = min(tokens.bit_length() - 1, len(ts) - 2)  # segment [2^i, 2^(i+1)]
        lo = 1 << i
        return ts[i] + (ts[i + 1] - ts[i]) * (tokens - lo) / lo

    def best(self, rows: int, most: int) -> int:
        """The drafts this step should take with `rows` requests decoding, at most `most`."""
        if most <= 0 or rows <= 0:
            return 0
        known = self._best.get((rows, most))
        if known is None:
            known = self._best[(rows, most)] = self._search(rows, most)
        return known

    def _search(self, rows: int, most: int) -> int:
        plain = rows / self.step_time(rows)
        best_d, best_rate = 0, MIN_GAIN * plain
        stride = max(1, most // MAX_CANDIDATES)
        alpha, gap = self.acceptance, self.gap_s
        for d in range(stride, most + 1, stride):
            rate = (rows + alpha * d) / (self.step_time(rows + d) + gap)
            if rate > best_rate:
                best_d, best_rate = d, rate
        return best_d

    def verified(self, drafted: int, accepted: int) -> None:
        self.drafted = DECAY * self.drafted + drafted
        self.accepted = DECAY * self.accepted + accepted
        self._best.clear()

    def waited(self, seconds: float) -> None:
        """The worker's idle time before a step with drafts (it waited for the scheduler)."""
        self.gap_s = seconds if not self.gap_s else 0.9 * self.gap_s + 0.1 * seconds
        self._best.clear()
