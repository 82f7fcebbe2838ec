"""Predicted remaining work of a request: how many tokens it will still output, and what the rest
of its service costs on a worker.

Output length: a request stops at ``max_tokens`` or earlier (EOS, a stop token). What fraction
of ``max_tokens`` requests actually use is learned per tenant and prompt-length bucket (powers of
two), falling back to the tenant's, then everyone's, then 1 (no history: ``max_tokens``). Each
prediction made when a request is first seen is checked against its real output length when it
finishes; ``error()`` reports the mean absolute and the mean signed error (the bias).

Targets: an absolute deadline, a TTFT target (the first token due at ``ttft_deadline``) and a
TPOT target (mean time between output tokens at most ``tpot_target_s``). ``due`` folds them into
the time by which the rest of the request must be done: a request whose first token is still to
come must have it by ``ttft_deadline`` and then decode at one step per token; a TPOT target is no
deadline (waiting does not spend it) but bounds the step time of the batch the request shares.
``targets_met`` says whether a finished request met all of its targets.

Cost: the worker's measured step costs (the simulator's cost model and SLO admission fit the same
``a + b * tokens``): a prefill token costs ``prefill_s_per_token``; an output token costs one
decode step of latency (``decode_s_per_token``) but only its share of a batched step in machine
time (``decode_work_s_per_token``). Latency bounds when the request alone could finish; machine
time is what it takes from the others. A policy the service gives no costs learns the same line
from the steps it sees on its own clock (``StepClock``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler_svc.core.request import FinishReason, Request, RequestStatus

_LEARNED_REASONS = (FinishReason.STOP, FinishReason.LENGTH)


@dataclass(slots=True)
class _RatioStats:
    count: int = 0
    total: float = 0.0

    def mean(self) -> float:
        return self.total / self.count


@dataclass(slots=True)
class PredictionError:
    """Predicted minus actual output tokens over the finished requests checked."""

    count: int = 0
    abs_total: float = 0.0
    signed_total: float = 0.0

    @property
    def mean_abs_tokens(self) -> float:
        return self.abs_total / self.count if self.count else 0.0

    @property
    def mean_signed_tokens(self) -> float:
        return self.signed_total / self.count if self.count else 0.0


def prompt_bucket(num_prompt_tokens: int) -> int:
    return max(1, num_prompt_tokens).bit_length()


@dataclass(slots=True)
class OutputLengthPredictor:
    """Output length from max_tokens and the observed fraction of it used (see module doc)."""

    min_observations: int = 4  # a bucket with fewer falls back to the tenant's, then global
    _by_bucket: dict[tuple[str, int], _RatioStats] = field(default_factory=dict)
    _by_tenant: dict[str, _RatioStats] = field(default_factory=dict)
    _overall: _RatioStats = field(default_factory=_RatioStats)
    _first_prediction: dict[str, int] = field(default_factory=dict)
    error: PredictionError = field(default_factory=PredictionError)

    def _ratio(self, request: Request) -> float:
        tenant = request.tenant or ""
        enough = self.min_observations
        for stats in (
            self._by_bucket.get((tenant, prompt_bucket(request.num_prompt_tokens))),
            self._by_tenant.get(tenant),
            self._overall,
        ):
            if stats is not None and stats.count >= enough:
                return stats.mean()
        return 1.0

    def predict(self, request: Request) -> int:
        """Total output tokens the request is expected to produce (at least what it has)."""
        params = request.sampling_params
        guess = math.ceil(params.max_tokens * self._ratio(request))
        guess = max(guess, params.min_tokens, request.num_output_tokens, 1)
        guess = min(guess, max(params.max_tokens, request.num_output_tokens))
        self._first_prediction.setdefault(request.request_id, guess)
        return guess

    def outputs_left(self, request: Request) -> int:
        """Output tokens still to come (at least one while the request is unfinished)."""
        return max(1, self.predict(request) - request.num_output_tokens)

    def observe(self, request: Request) -> None:
        """A finished request: learn its tenant's and bucket's ratio and check the prediction."""
        predicted = self._first_prediction.pop(request.request_id, None)
        if request.finish_reason not in _LEARNED_REASONS:
            return  # aborted or shed: says nothing about how long it would have run
        actual = request.num_output_tokens
        if predicted is not None:
            err = self.error
            err.count += 1
            err.abs_total += abs(predicted - actual)
            err.signed_total += predicted - actual
        max_tokens = request.sampling_params.max_tokens
        if max_tokens <= 0:
            return
        ratio = min(1.0, actual / max_tokens)
        tenant = request.tenant or ""
        key = (tenant, prompt_bucket(request.num_prompt_tokens))
        for stats in (
            self._by_bucket.setdefault(key, _RatioStats()),
            self._by_tenant.setdefault(tenant, _RatioStats()),
            self._overall,
        ):
            stats.count += 1
            stats.total += ratio

    def forget(self, request_id: str) -> None:
        self._first_prediction.pop(request_id, None)


@dataclass(slots=True, frozen=True)
class ServiceCosts:
    """Seconds per token on one worker (see module doc)."""

    prefill_s_per_token: float = 2e-4
    decode_s_per_token: float = 0.02
    decode_work_s_per_token: float = 0.02

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "decode_s_per_token", "decode_work_s_per_token"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number >= 0; got {v!r}")
            if v < 0:
                raise ValueError(f"{name} must be a finite number >= 0; got {v!r}")


@dataclass(slots=True, frozen=True)
class StepFit:
    """A worker's step time as measured: ``base_s + per_token_s * tokens`` (the service fits it
    online from the steps the workers ran, as SLO admission does)."""

    base_s: float
    per_token_s: float

    @property
    def usable(self) -> bool:
        """A fit that says something: finite, not negative, and a step takes time."""
        a, b = self.base_s, self.per_token_s
        return math.isfinite(a) and math.isfinite(b) and a >= 0 and b >= 0 and a + b > 0

    def service_costs(self, batch: int) -> ServiceCosts:
        """A prompt token costs its marginal share of a step; an output token one step of one
        sequence in latency, and its share of a step of ``batch`` sequences in machine time."""
        a, b = self.base_s, self.per_token_s
        batch = max(1, batch)
        return ServiceCosts(b, a + b, (a + b * batch) / batch)


@dataclass(slots=True)
class StepClock:
    """A worker's step time learned on the policy's clock, for a policy the service gives no
    cost fit. The time between two steps that both ran a request is one step of the earlier,
    whose tokens it pays for (a request runs on one worker, so steps of other workers sharing
    the policy never pair up). ``fit`` is the exponentially weighted least-squares line of
    those seconds against tokens computed. A gap far longer than the line predicts is the
    worker idling, not computing, unless such gaps keep coming: then the steps slowed and the
    line starts over from them."""

    weight: float = 0.1  # of the newest step: recent steps count, an odd one does not take over
    idle_factor: float = 4.0
    patience: int = 3
    batch: float = 1.0  # mean requests per step
    _last: dict[str, tuple[float, int, Request]] = field(default_factory=dict)
    _count: int = 0
    _long: int = 0  # long gaps in a row
    _mean_tokens: float = 0.0
    _mean_s: float = 0.0
    _var_tokens: float = 0.0
    _cov: float = 0.0

    def step(
        self, now: float, requests: Sequence[Request], num_tokens: Sequence[int]
    ) -> StepFit | None:
        """One step scheduled at ``now``; the new fit when it learned from the step."""
        last = self._last
        for rid in [rid for rid, seen in last.items() if seen[2].status is RequestStatus.FINISHED]:
            del last[rid]
        tokens = sum(num_tokens)
        gap: tuple[float, int] | None = None  # the shortest: a request may have sat out steps
        for r in requests:
            seen = last.get(r.request_id)
            if seen is not None and (gap is None or now - seen[0] < gap[0]):
                gap = (now - seen[0], seen[1])
            last[r.request_id] = (now, tokens, r)
        if gap is None or not self._add(gap[1], gap[0], len(requests)):
            return None
        fit = self.fit()
        return fit if fit is not None and fit.usable else None

    def _add(self, tokens: int, seconds: float, seqs: int) -> bool:
        if seconds <= 0 or tokens <= 0:
            return False
        if self._count and seconds > self.idle_factor * self.predict_s(tokens):
            self._long += 1
            if self._long < self.patience:
                return False
            self._count = 0
        self._long = 0
        w = self.weight
        if not self._count:
            self._mean_tokens, self._mean_s, self._var_tokens, self._cov = tokens, seconds, 0, 0
            self.batch = seqs
        else:
            dx, dy = tokens - self._mean_tokens, seconds - self._mean_s
            self._mean_tokens += w * dx
            self._mean_s += w * dy
            self._var_tokens = (1 - w) * (self._var_tokens + w * dx * dx)
            self._cov = (1 - w) * (self._cov + w * dx * dy)
            self.batch += w * (seqs - self.batch)
        self._count += 1
        return True

    def fit(self) -> StepFit | None:
        """The learned line (None before two steps of one request were seen); neither its base
        nor its price per token below zero."""
        if not self._count:
            return None
        slope = self._cov / self._var_tokens if self._var_tokens > 0 else 0.0
        slope = min(max(slope, 0.0), self._mean_s / self._mean_tokens)
        return StepFit(self._mean_s - slope * self._mean_tokens, slope)

    def predict_s(self, tokens: int) -> float:
        fit = self.fit()
        return 0.0 if fit is None else fit.base_s + fit.per_token_s * tokens


def tokens_to_compute(request: Request) -> int:
    """Tokens known but not computed: the prompt left to prefill (a recomputed request: also
    its output so far)."""
    return max(0, request.num_tokens - request.num_computed_tokens)


def latency_s(request: Request, outputs_left: int, costs: ServiceCosts) -> float:
    """The soonest the request could finish from now if it ran alone."""
    return (
        tokens_to_compute(request) * costs.prefill_s_per_token
        + outputs_left * costs.decode_s_per_token
    )


def work_s(request: Request, outputs_left: int, costs: ServiceCosts) -> float:
    """The worker time the rest of the request takes from everyone (decode batched)."""
    return (
        tokens_to_compute(request) * costs.prefill_s_per_token
        + outputs_left * costs.decode_work_s_per_token
    )


def has_targets(request: Request) -> bool:
    return (
        request.deadline is not None
        or request.ttft_deadline is not None
        or request.tpot_target_s is not None
    )


def due(request: Request, outputs_left: int, costs: ServiceCosts) -> float | None:
    """When the rest of the request must be done to meet its deadline and TTFT target (None:
    neither applies any more); see the module doc."""
    d = request.deadline
    first = request.ttft_deadline
    if first is not None and request.num_output_tokens == 0:
        by_first = first + max(0, outputs_left - 1) * costs.decode_s_per_token
        d = by_first if d is None else min(d, by_first)
    return d


DEADLINE = "deadline"
TTFT_TARGET = "time-to-first-token target"
TPOT_TARGET = "time-per-output-token target"


def missed_target(
    request: Request, outputs_left: int, costs: ServiceCosts, step_alone_s: float
) -> str:
    """The target a hopeless request can no longer meet, named for its client: its TPOT target
    when one decode step alone is slower, else whichever of its TTFT target and deadline
    ``due`` took (the earlier)."""
    tpot = request.tpot_target_s
    if tpot is not None and step_alone_s > tpot:
        return TPOT_TARGET
    first = request.ttft_deadline
    if first is not None and request.num_output_tokens == 0:
        by_first = first + max(0, outputs_left - 1) * costs.decode_s_per_token
        if request.deadline is None or by_first <= request.deadline:
            return TTFT_TARGET
    return DEADLINE


def targets_met(
    *,
    arrival: float,
    first_token: float | None,
    finish: float,
    num_outputs: int,
    deadline: float | None = None,
    ttft_target_s: float | None = None,
    tpot_target_s: float | None = None,
) -> bool:
    """A finished request met its targets: done by the deadline, first token within the TTFT
    target, mean time between output tokens within the TPOT target."""
    if deadline is not None and finish > deadline:
        return False
    if ttft_target_s is not None and (first_token is None or first_token - arrival > ttft_target_s):
        return False
    if tpot_target_s is not None and first_token is not None and num_outputs > 1:
        return (finish - first_token) / (num_outputs - 1) <= tpot_target_s
    return True
