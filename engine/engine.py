"""The engine: continuous batching with DFlash speculative decoding, as a library.

Control only (no tensors here, as nano-vllm): `add_request` validates and queues, `abort`
marks, `step()` is one iteration that reads schedule -> spec_step -> commit: the torch-free
scheduler retires and admits, the ModelRunner (runner.py) prefills the admitted and runs ONE
speculative step over every running sequence, and each sequence commits its tokens through
its stop conditions. `stats()` feeds the worker's metrics. The asyncio face (a step thread
and per-request streams) is async_engine.py.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.errors import EngineError, QueueFull, RequestRejected
from engine.runner import ModelRunner
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import RequestOutput, SamplingParams, Sequence, slot_of
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.speculative import RowResult

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "QueueFull",
    "RequestRejected",
]


@dataclass(frozen=True)
class EngineStats:
    """Load gauges and cumulative counters, named after the vLLM metrics they feed."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    # The KV cache's shape in vLLM's cache-config terms (vllm:cache_config_info): a request
    # owns one preallocated slot, so a "block" is a slot and its size the slot's positions.
    kv_block_size: int
    kv_num_blocks: int
    num_spec_tokens: int  # 0 without a drafter
    num_drafts: int  # verify steps (one per running request per spec step)
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]  # len num_spec_tokens: steps that accepted draft i
    steps_by_k: list[int]  # len num_spec_tokens + 1: row-steps that verified k drafts
    prompt_tokens: int
    generation_tokens: int
    num_requests_finished: int
    # Cumulative seconds and forwards per kind of step work (runner.STEP_KINDS).
    step_seconds: dict[str, float] = field(default_factory=dict)
    step_counts: dict[str, int] = field(default_factory=dict)


@dataclass
class _Counters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    steps_by_k: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_requests_finished: int = 0


# The most top log-probabilities a request may ask for per token (vLLM's max_logprobs).
MAX_LOGPROBS = 20
# The most bad words a request may name (vLLM's VLLM_MAX_NUM_BAD_WORDS).
MAX_BAD_WORDS = 128
# The most logit_bias entries (vLLM's GPU model runner's limit).
MAX_LOGIT_BIAS = 1024


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.max_model_len = config.max_model_len
        self.tokenizer = Tokenizer.from_dir(config.target_path)
        self._eos_ids = frozenset(self.tokenizer.eos_token_ids)
        self.runner = ModelRunner(config)
        self.block_size = self.runner.block_size
        self.num_spec_tokens = self.runner.num_spec_tokens
        self.vocab_size = self.runner.vocab_size
        self._scheduler = Scheduler(config.max_num_seqs, config.max_waiting)
        # Requests arrive on the event loop while steps run on the step thread.
        self._lock = threading.Lock()
        k = self.num_spec_tokens or 0
        self._counters = _Counters(accepted_per_pos=[0] * k, steps_by_k=[0] * (k + 1))
        self.accepting = True

    @property
    def has_work(self) -> bool:
        return self._scheduler.has_work

    def describe(self) -> str:
        """What it decodes with, for the worker's ready line."""
        kind = self.runner.drafter_kind
        if kind is None:
            return "plain decoding"
        how = "k chosen per step" if self.config.adaptive else "every step"
        return (
            f"{kind} drafter {self.config.drafter_path}, up to {self.num_spec_tokens} "
            f"drafts a step ({how})"
        )

    # ---- requests -------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected for a request that can never be served as asked."""
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty: at least one token is needed", "prompt")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        _validate_params(params)
        _validate_token_ids(params, self.vocab_size)
        limit = self.max_model_len
        if params.max_tokens is not None and params.max_tokens > limit:
            raise RequestRejected(
                f"max_tokens={params.max_tokens} cannot be greater than max_model_len={limit}. "
                "Please request fewer output tokens.",
                "max_tokens",
                "context_length_exceeded",
            )
        if n >= limit:
            raise RequestRejected(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains {n} input tokens, which leaves no room for output tokens. Please "
                "reduce the length of the input prompt.",
                "prompt",
                "context_length_exceeded",
            )
        # A prompt plus max_tokens past the limit is served as vLLM does: the completion
        # stops at the context limit with finish_reason "length".

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Sequence:
        """Validate and queue a request."""
        if not self.accepting:
            raise QueueFull("the engine is shutting down")
        self.validate(prompt_token_ids, params)
        try:
            bad_words = self.tokenizer.bad_words(params.bad_words)
        except ValueError:
            raise RequestRejected(
                "bad_words entries must tokenize to at least one token.", "bad_words"
            ) from None
        if params.allowed_token_ids is not None:
            banned = {w[0] for w in bad_words if len(w) == 1}
            if params.min_tokens > 0:
                banned |= set(params.stop_token_ids) | self._eos_ids
            if set(params.allowed_token_ids) <= banned:
                raise RequestRejected(
                    "allowed_token_ids leaves no token to generate: every one is a bad word "
                    "or, before min_tokens, a stop token",
                    "allowed_token_ids",
                )
        seq = Sequence(
            request_id,
            list(prompt_token_ids),
            params,
            detokenizer=self.tokenizer.detokenizer(prompt_token_ids),
            eos_token_ids=self._eos_ids,
            max_model_len=self.max_model_len,
            arrival_time=time.monotonic(),
            num_spec_tokens=self.num_spec_tokens,
            adaptive=self.runner.policy is not None,
            bad_words_token_ids=bad_words,
        )
        with self._lock:
            self._scheduler.add(seq)  # QueueFull propagates; nothing to undo
            self.runner.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop a request; its slot is freed at the next step."""
        seq.abort_requested = True

    def abort_all(self) -> None:
        with self._lock:
            self._scheduler.abort_all()

    # ---- one step -------------------------------------------------------------------

    def step(self) -> list[tuple[Sequence, RequestOutput]]:
        """One engine iteration (blocking): schedule -> spec_step -> commit. Returns the
        outputs of every sequence that produced one, with the sequence."""
        with self._lock:
            batch = self._scheduler.schedule(time.monotonic())
        self._release(batch)
        if batch.prefill:
            self._commit_prefill(batch.prefill, self.runner.prefill(batch.prefill))
        # A sequence prefilled in this step decodes from the next one, so its first token goes
        # out alone, right after the prefill (as vLLM's): the client's first token is early.
        # In slot order: rows in consecutive slots are read from the caches as views, while
        # any other order gathers (copies) every row's keys and values, which at 32 rows
        # and 600 tokens of context made a step 1.85x dearer.
        decode = sorted((s for s in batch.decode if not s.finished), key=slot_of)
        if decode:
            self._commit_decode(decode)
        with self._lock:
            done = self._scheduler.retire(time.monotonic())
        self._release(done)
        touched = _unique([*batch.retired, *batch.prefill, *batch.decode])
        return [(s, out) for s in touched if (out := s.take_output()) is not None]

    def recover(self) -> None:
        """After a failed step: end every request and empty every slot."""
        with self._lock:
            self._scheduler.abort_all()
            batch = self._scheduler.retire(time.monotonic())
        self._release(batch)

    def _release(self, batch: ScheduledBatch) -> None:
        for slot in batch.freed_slots:
            self.runner.free_slot(slot)
        for src, dst in batch.moved:
            self.runner.move_slot(src, dst)
        for seq in batch.retired:
            self.runner.remove(seq)
            self._counters.num_requests_finished += 1

    def _commit_prefill(self, seqs: list[Sequence], firsts: list[RowResult]) -> None:
        now = time.monotonic()
        counters = self._counters
        for seq, first in zip(seqs, firsts, strict=True):
            counters.prompt_tokens += seq.num_prompt_tokens
            seq.prompt_logprobs = first.prompt_logprobs
            counters.generation_tokens += seq.append(first.token_ids, now, first.logprobs)

    def _commit_decode(self, seqs: list[Sequence]) -> None:
        results = self.runner.decode(seqs)
        now = time.monotonic()
        counters = self._counters
        for seq, result in zip(seqs, results, strict=True):
            counters.generation_tokens += seq.append(result.token_ids, now, result.logprobs)
            spec = seq.metrics.spec
            if spec is None:
                continue
            counters.steps_by_k[result.num_drafted] += 1
            if result.num_drafted == 0:  # an adaptive plain step: no draft was verified
                spec.num_plain_steps += 1
                continue
            spec.observe(result.num_drafted, result.num_accepted)
            counters.num_drafts += 1
            counters.num_draft_tokens += result.num_drafted
            counters.num_accepted_tokens += result.num_accepted
            for pos in range(result.num_accepted):
                counters.accepted_per_pos[pos] += 1

    def stats(self) -> EngineStats:
        c = self._counters
        shape = self.runner.kv_cache_shape()
        return EngineStats(
            num_running=self._scheduler.num_running,
            num_waiting=self._scheduler.num_waiting,
            kv_cache_usage=self.runner.kv_cache_usage(),
            kv_block_size=shape.capacity,
            kv_num_blocks=shape.num_slots,
            num_spec_tokens=self.num_spec_tokens or 0,
            num_drafts=c.num_drafts,
            num_draft_tokens=c.num_draft_tokens,
            num_accepted_tokens=c.num_accepted_tokens,
            accepted_per_pos=list(c.accepted_per_pos),
            steps_by_k=list(c.steps_by_k),
            prompt_tokens=c.prompt_tokens,
            generation_tokens=c.generation_tokens,
            num_requests_finished=c.num_requests_finished,
            step_seconds=dict(self.runner.profile.seconds),
            step_counts=dict(self.runner.profile.counts),
        )


def _unique(seqs: Iterable[Sequence]) -> list[Sequence]:
    return list({id(s): s for s in seqs}.values())


def _validate_params(params: SamplingParams) -> None:
    if params.max_tokens is not None and params.max_tokens < 1:
        raise RequestRejected(
            f"max_tokens must be at least 1, got {params.max_tokens}", "max_tokens"
        )
    if not params.temperature >= 0:
        raise RequestRejected(f"temperature must be >= 0, got {params.temperature}", "temperature")
    if not 0 < params.top_p <= 1:
        raise RequestRejected(f"top_p must be in (0, 1], got {params.top_p}", "top_p")
    if params.top_k < 0:
        raise RequestRejected(f"top_k must be >= 0 (0 = off), got {params.top_k}", "top_k")
    if any(not s for s in params.stop):
        raise RequestRejected("stop strings must not be empty", "stop")
    if not 0 <= params.min_p <= 1:
        raise RequestRejected(f"min_p must be in [0, 1], got {params.min_p}.", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not -2 <= value <= 2:
            raise RequestRejected(f"{name} must be in [-2, 2], got {value}.", name)
    if not (math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0):
        raise RequestRejected(
            f"repetition_penalty must be a finite number greater than zero, got "
            f"{params.repetition_penalty}.",
            "repetition_penalty",
        )
    if params.min_tokens < 0:
        raise RequestRejected(
            f"min_tokens must be greater than or equal to 0, got {params.min_tokens}.",
            "min_tokens",
        )
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise RequestRejected(
            f"min_tokens must be less than or equal to max_tokens={params.max_tokens}, "
            f"got {params.min_tokens}.",
            "min_tokens",
        )
    if any(not w.strip() for w in params.bad_words):
        raise RequestRejected("bad_words entries must tokenize to at least one token.", "bad_words")
    if len(params.bad_words) > MAX_BAD_WORDS:
        raise RequestRejected(
            f"Too many bad words: {len(params.bad_words)}. The max number is {MAX_BAD_WORDS}.",
            "bad_words",
        )
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise RequestRejected(
            f"Too many logit bias tokens: {len(params.logit_bias)}. The max size is "
            f"{MAX_LOGIT_BIAS}.",
            "logit_bias",
        )
    for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        value = getattr(params, name)
        if value is not None and value < 0:
            raise RequestRejected(f"{name} must be non-negative, got {value}.", name)
        if value is not None and value > MAX_LOGPROBS:
            raise RequestRejected(
                f"Requested {kind} logprobs of {value}, which is greater than max "
                f"allowed: {MAX_LOGPROBS}",
                name,
            )


def _validate_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids a request names must exist (vLLM's messages)."""
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", [t for t, _ in params.logit_bias]),
    ):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestRejected(
                f"token_id(s) {bad} in {name} contain out-of-vocab token ids. "
                f"Vocabulary size: {vocab_size}",
                name,
            )
    allowed = params.allowed_token_ids
    if allowed is not None and not allowed:
        raise RequestRejected("allowed_token_ids is not None and empty!", "allowed_token_ids")
    if allowed is not None and not all(0 <= t < vocab_size for t in allowed):
        raise RequestRejected(
            "allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids"
        )
