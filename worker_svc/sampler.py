"""Token sampling for a batch of rows, each with its own parameters (vLLM V1 semantics).

Order: raw logprobs (if asked) -> grammar masks -> penalties -> greedy argmax | temperature ->
min-p -> top-k / top-p -> sample. Logprobs stay the model's raw distribution for every row, a
constrained one included; the grammar mask (tokens it disallows at -inf) comes before everything
that picks a token, so greedy and every sampling setting respect it.

Sampling inverts each row's cumulative distribution at one uniform draw, which draws from
`probs` exactly; a row with a seed draws its uniform from its own torch.Generator, so what it
samples depends only on its logits and its seed, never on its batch neighbours. One random number
per row: the exponential race `argmax(probs / q)` that GPU samplers use to avoid a host sync
needs one per vocabulary entry, and on a CPU drawing those costs more than the forward pass. An
all-greedy batch takes one argmax and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from worker_svc.structured_output import unpack


@dataclass(slots=True)
class TokenLogprobs:
    """A sampled token's logprob and the top-n (token, logprob) of its distribution."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row parameters of the rows to sample, as tensors (None: nobody uses it)."""

    num_rows: int
    all_greedy: bool = True
    temperature: torch.Tensor | None = None  # [R] float, 0 = greedy
    top_k: torch.Tensor | None = None  # [R] int64, vocab size when off
    top_p: torch.Tensor | None = None  # [R] float, 1 when off
    min_p: torch.Tensor | None = None  # [R] float, 0 when off
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> own generator
    # penalties, for the rows in penalty_rows only
    penalty_rows: torch.Tensor | None = None  # [P] int64
    presence: torch.Tensor | None = None  # [P]
    frequency: torch.Tensor | None = None  # [P]
    repetition: torch.Tensor | None = None  # [P]
    prompt_mask: torch.Tensor | None = None  # [P, V] bool: token occurs in the prompt
    output_counts: torch.Tensor | None = None  # [P, V] float: occurrences in the output
    num_logprobs: list[int | None] | None = None  # per row top-n, None: row wants none
    # structured output, for the rows in mask_rows only (worker_svc/structured_output.py)
    mask_rows: torch.Tensor | None = None  # [C] int64, ascending
    allowed: torch.Tensor | None = None  # [C, V] bool: the token is allowed next
    packed_masks: torch.Tensor | None = None  # [C, words] int32, instead of allowed (native)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64
    logprobs: list[TokenLogprobs | None] | None = None


class Sampler:
    def __init__(self, generator: torch.Generator, fast_argmax=None, packed_mask=None) -> None:
        self.generator = generator  # for rows without their own seed
        # logits -> token ids or None (a native row argmax: greedy batches skip the float copy)
        self.fast_argmax = fast_argmax
        # (logits, rows, packed masks) -> applied or not (worker_svc/token_mask.py)
        self.packed_mask = packed_mask

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if (
            meta.all_greedy
            and meta.num_logprobs is None
            and meta.penalty_rows is None
            and meta.allowed is None
            and meta.packed_masks is None
            and self.fast_argmax is not None
        ):
            tokens = self.fast_argmax(logits)  # the same ids: float conversion keeps the order
            if tokens is not None:
                return SamplerOutput(tokens)
        logits = logits.float()
        raw_logprobs = None
        if meta.num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if meta.packed_masks is not None:
            packed = meta.packed_masks
            if not self.packed_mask or not self.packed_mask(logits, meta.mask_rows, packed):
                allowed = token_masks(packed.numpy(), logits.shape[1], logits.device)
                apply_token_mask(logits, meta.mask_rows, allowed)
        elif meta.allowed is not None:
            apply_token_mask(logits, meta.mask_rows, meta.allowed)
        if meta.penalty_rows is not None:
            apply_penalties(logits, meta)
        if meta.all_greedy:
            tokens = _argmax(logits)
        else:
            tokens = self._sample(logits, meta)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, tokens, meta.num_logprobs)
        return SamplerOutput(tokens, logprobs)

    def probabilities(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Each row's sampling distribution: temperature (greedy rows at 1), min-p, top-k and
        top-p applied, softmaxed."""
        assert meta.temperature is not None
        greedy = meta.temperature == 0
        temp = torch.where(greedy, torch.ones_like(meta.temperature), meta.temperature)
        logits = logits / temp.unsqueeze(1)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        return torch.softmax(logits, dim=-1)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        assert meta.temperature is not None
        greedy = meta.temperature == 0
        greedy_tokens = _argmax(logits) if bool(greedy.any()) else None
        probs = self.probabilities(logits, meta)
        tokens = _inverse_cdf(probs, self._uniforms(len(probs), meta.generators))
        if greedy_tokens is not None:
            tokens = torch.where(greedy, greedy_tokens, tokens)
        return tokens

    def _uniforms(self, rows: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """One U[0, 1) draw per row: the seeded rows' from their own generators."""
        shared = self.generator
        u = torch.rand(rows, dtype=torch.float64, generator=shared, device=shared.device)
        for row, gen in generators.items():
            u[row] = torch.rand(1, dtype=torch.float64, generator=gen, device=gen.device)[0]
        return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability reaches (1 - u) of the row's
    total: a point strictly inside the mass, so a token of probability 0 (filtered, masked) is
    never picked, the first one included. In float64, so that tokens of tiny probability keep
    their share of the sum."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    targets = (1.0 - u.to(cdf.device)).unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, targets).squeeze(1).clamp_max_(probs.shape[1] - 1)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first maximum, like argmax) through max().indices, which is much faster
    than torch.argmax on the CPU."""
    return torch.max(x, dim=-1).indices


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """In place, on meta.penalty_rows: repetition over prompt + output (divide positive logits,
    multiply negative ones), then frequency (times the output count) and presence (once if the
    token occurs in the output) subtracted, as vLLM defines them."""
    rows = meta.penalty_rows
    assert rows is not None and meta.output_counts is not None and meta.prompt_mask is not None
    sub = logits.index_select(0, rows)
    counts = meta.output_counts
    seen = meta.prompt_mask | (counts > 0)
    rep = meta.repetition.unsqueeze(1).expand_as(sub)
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalised, sub)
    sub -= meta.frequency.unsqueeze(1) * counts
    sub -= meta.presence.unsqueeze(1) * (counts > 0).to(sub.dtype)
    logits.index_copy_(0, rows, sub)


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> None:
    """In place: on each of `rows`, the tokens its grammar does not allow get -inf."""
    if len(rows) == len(logits):  # every row constrained (rows ascending: all of them, in order)
        logits.masked_fill_(~allowed, float("-inf"))
        return
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)


def token_masks(masks: np.ndarray, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Packed grammar masks (int32 [C, words], llguidance's bit order) as bool [C, vocab_size].
    On the CPU numpy unpacks them; elsewhere the packed words travel (32 times fewer bytes)
    and unpack on the device."""
    if device.type == "cpu":
        return torch.from_numpy(unpack(masks, vocab_size)).view(torch.bool)
    words = torch.from_numpy(masks).to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).view(len(masks), -1).bool()
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    padded = torch.zeros(len(masks), vocab_size, dtype=torch.bool, device=device)
    padded[:, : bits.shape[1]] = bits
    return padded


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's top_k tokens, then its smallest set with probability mass >= top_p."""
    if top_p is None:
        assert top_k is not None
        max_k = int(top_k.max())
        kth = logits.topk(max_k, dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = sorted_logits.gather(1, (logits.shape[-1] - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False  # the top token always stays
    sorted_logits.masked_fill_(drop, float("-inf"))
    return sorted_logits.scatter(-1, order, sorted_logits)


def gather_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, num: list[int | None]
) -> list[TokenLogprobs | None]:
    """Each asking row's sampled-token logprob and its top-n."""
    max_n = max((n for n in num if n is not None), default=0)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    top_vals, top_ids = logprobs.topk(max(max_n, 1), dim=-1)
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    token_list = tokens.tolist()
    out: list[TokenLogprobs | None] = []
    for i, n in enumerate(num):
        top = None if n is None else list(zip(top_ids[i][:n], top_vals[i][:n], strict=True))
        out.append(None if top is None else TokenLogprobs(token_list[i], chosen[i], top))
    return out
