"""Structured output on the worker: one llguidance matcher per constrained request, and the
packed mask of the tokens its grammar allows next (docs/structured_output.md).

    so = StructuredOutputs(load_tokenizer, vocab_size, eos_token_id)
    so.add(req_id, params.structured, output_token_ids)  # when the diff adds or resumes it
    picked = so.masks(sampling_req_ids)   # before sampling: (positions, int32 [C, words])
    so.advance(sampling_req_ids, tokens)  # after sampling

Every matcher operation (building the tokenizer, compiling, replaying the tokens a request
arrives with, consuming a sampled token, filling the next mask) runs on one background thread,
in the order the step submits it, so the main thread never touches a matcher. `advance` at the
end of step N queues the consume and the step N+1 mask; `add` queues a new row's compile; both
run while the next forward pass does (llguidance drops the GIL while it fills a mask), and
`masks` waits for them just before sampling. A worker that never sees a constrained request
starts no thread and allocates nothing.

A matcher in error (a grammar that slipped past validation, a token it refuses, no tokenizer)
allows only EOS from then on and is logged once as `structured_output_error`. The worker's answer
carries sampled tokens only, so the request then ends through the scheduler's EOS check, with
finish_reason stop; under ignore_eos it keeps sampling EOS until its length limit.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.logging import get_logger
from common.messages import StructuredOutput
from common.structured import grammar, ll_tokenizer

log = get_logger("splitserve.worker.structured_output")

THREAD_NAME = "structured-output"
MATCHER_NICE = 10  # added to the worker's own niceness, on the matcher thread only
COMPILED_CACHE = 64  # pristine matchers kept per grammar: a new or resumed row deep-copies one


@dataclass(slots=True)
class _Row:
    structured: StructuredOutput
    matcher: Any = None  # llguidance.LLMatcher, touched on the background thread only
    mask: np.ndarray | None = None  # int32 [words]: what the matcher allows next
    error: str = ""
    reported: bool = False


class StructuredOutputs:
    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_id: int | None
    ) -> None:
        self._load_tokenizer = load_tokenizer  # -> a common.tokenizer.Tokenizer
        self.vocab_size = vocab_size  # the logits' width; masks are padded or cut to it
        self._eos_token_id = eos_token_id
        self._rows: dict[str, _Row] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._last: Future | None = None
        # built on the background thread at the first constrained request
        self._ll: Any = None
        self._ll_error = ""
        self._eos_only: np.ndarray | None = None
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()

    @property
    def active(self) -> bool:
        """Does any request held here have a constraint."""
        return bool(self._rows)

    @property
    def thread_started(self) -> bool:
        return self._pool is not None

    # --- main thread ---

    def add(
        self, req_id: str, structured: StructuredOutput | None, output_token_ids: Sequence[int]
    ) -> None:
        """A request that (re)enters the batch with these output tokens; None: unconstrained."""
        if structured is None:
            self._rows.pop(req_id, None)
            return
        row = self._rows[req_id] = _Row(structured)
        self._submit(self._start, row, list(output_token_ids))

    def remove(self, req_id: str) -> None:
        self._rows.pop(req_id, None)

    def clear(self) -> None:
        self._rows.clear()

    def masks(self, req_ids: Sequence[str]) -> tuple[list[int], np.ndarray] | None:
        """For the requests about to sample (in this order): the positions of the constrained
        ones and their packed masks (int32 [C, words], bit t of word w allows token 32w + t);
        None when none is constrained."""
        rows = self._rows
        picked = [i for i, r in enumerate(req_ids) if r in rows]
        if not picked:
            return None
        self._join()
        masks = []
        for i in picked:
            row = rows[req_ids[i]]
            if row.error and not row.reported:
                row.reported = True
                log.warning("structured_output_error", request_id=req_ids[i], error=row.error)
            masks.append(row.mask)
        return picked, np.stack(masks)

    def advance(self, req_ids: Sequence[str], tokens: Sequence[int]) -> None:
        """The tokens the requests just sampled: consume them and fill the next masks."""
        rows = self._rows
        moved = [(rows[r], t) for r, t in zip(req_ids, tokens, strict=True) if r in rows]
        if moved:
            self._submit(self._consume, moved)

    def _submit(self, fn, *args) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                1, thread_name_prefix=THREAD_NAME, initializer=_yield_to_the_forward
            )
        self._last = self._pool.submit(fn, *args)

    def _join(self) -> None:
        """Wait for everything queued (one thread: the last task ends last)."""
        if self._last is not None:
            last, self._last = self._last, None
            last.result()

    # --- background thread: tasks never raise; a row that fails is forced to EOS ---

    def _start(self, row: _Row, output_token_ids: list[int]) -> None:
        try:
            matcher = self._compile(row.structured).deep_copy()
            if output_token_ids:
                matcher.consume_tokens(output_token_ids)
            row.matcher = matcher
            self._fill(row)
        except Exception as exc:  # noqa: BLE001 - reported when the row samples
            self._fail(row, f"{type(exc).__name__}: {exc}")

    def _consume(self, moved: list[tuple[_Row, int]]) -> None:
        for row, token in moved:
            if row.error:
                continue  # its mask stays EOS only
            try:
                row.matcher.consume_token(token)
                self._fill(row)
            except Exception as exc:  # noqa: BLE001 - reported when the row samples
                self._fail(row, f"{type(exc).__name__}: {exc}")

    def _fill(self, row: _Row) -> None:
        matcher = row.matcher
        mask = np.zeros_like(self._eos_only)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if matcher.is_error():
            self._fail(row, matcher.get_error())
        else:
            row.mask = mask

    def _fail(self, row: _Row, error: str) -> None:
        row.error = error or "the matcher failed"
        if self._eos_only is None:  # no tokenizer: force the model's EOS, if it has one
            row.mask = eos_mask(self._eos_token_id, self.vocab_size)
        else:
            row.mask = self._eos_only

    def _compile(self, structured: StructuredOutput):
        from llguidance import LLMatcher

        matcher = self._compiled.get(structured)
        if matcher is None:
            matcher = LLMatcher(self._tokenizer(), grammar(structured), log_level=0)
            self._compiled[structured] = matcher
            if len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(structured)
        return matcher

    def _tokenizer(self):
        if self._ll is None and not self._ll_error:
            try:
                tokenizer = self._load_tokenizer()
                eos = self._eos_token_id
                if eos is None:
                    eos = tokenizer.eos_token_id
                self._ll = ll_tokenizer(tokenizer, eos)
                self._eos_only = eos_mask(self._ll.eos_token, self._ll.vocab_size)
            except Exception as exc:  # noqa: BLE001 - every constrained row reports it
                self._ll_error = f"no tokenizer for structured output: {exc}"
        if self._ll is None:
            raise RuntimeError(self._ll_error)
        return self._ll


def _yield_to_the_forward() -> None:
    """Runs on the matcher thread: a lower priority (Linux nices threads one by one), so that
    where the forward pass's threads fill every core the masks fill the gaps between steps
    instead of preempting one of those threads, which every other one then waits for at the
    next barrier. The masks still get the CPU when a step waits for them."""
    try:
        thread = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, thread) + MATCHER_NICE
        os.setpriority(os.PRIO_PROCESS, thread, min(19, nice))
    except (AttributeError, OSError):  # not Linux, or not allowed: same priority then
        pass


def eos_mask(eos_token_id: int | None, vocab_size: int) -> np.ndarray:
    """A packed mask that allows only EOS (everything when there is no EOS: nothing to force)."""
    words = (vocab_size + 31) // 32
    if eos_token_id is None:
        return np.full(words, -1, dtype=np.int32)
    mask = np.zeros(words, dtype=np.uint32)
    mask[eos_token_id // 32] = 1 << (eos_token_id % 32)
    return mask.view(np.int32)


def allowed_token_ids(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids one packed mask allows, below vocab_size."""
    return np.flatnonzero(unpack(mask[None], vocab_size)[0])


def unpack(masks: np.ndarray, vocab_size: int) -> np.ndarray:
    """Packed int32 [C, words] -> uint8 0/1 [C, vocab_size]: tokens past the tokenizer's
    vocabulary (a logits width rounded up for the hardware) are never allowed."""
    return np.unpackbits(masks.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
