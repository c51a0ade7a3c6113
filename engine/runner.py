"""The ModelRunner: every tensor the engine holds (target, drafter, slot caches, sampling
generators) and the two things done with them, prefill and the speculative step.

The control side (engine.py) hands it scheduled sequences and gets plain Python tokens
back; nothing here decides who runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch

from engine.adaptive import SpecPolicy
from engine.calibration import calibrate_state
from engine.config import EngineConfig, block_size_for
from engine.kv_cache import KVCacheShape
from engine.layers import INT8_LINEAR
from engine.loader import load_drafter, load_target
from engine.logits_processors import LogitsProcessing
from engine.row_speculation import BandPriors, RowPlanner, StepPlan
from engine.sequence import SamplingParams, Sequence, slot_of
from engine.speculative import (
    DecodeRow,
    PrefillRow,
    RowResult,
    RowSampling,
    SpecState,
    catch_up,
    max_draft_tokens,
    move_slot,
    pending_context,
    prefill,
    release,
    spec_step,
    swap_slots,
    synchronize,
)

STEP_KINDS = ("prefill", "drafting", "plain", "catch_up")

# After the engine has idled this long between decode steps (requests far apart, the first
# step of a burst, a long prefill), the caches are cold: its next COLD_STEPS decode steps
# do not feed the cost feedback. They cost more whatever they verify (one row, 0.3 s
# apart: 1.42, 1.28, 1.21, 1.20x the model, then 1.09x; back to back, 1.16x, then 1.09x),
# and at one row they are always drafting ones (a new request's probes), so learnt as a
# draft count's cost they priced drafting 13 % dearer against plain than it runs.
COLD_GAP_S = 0.05
COLD_STEPS = 4
# One plain group in this many feeds the cost feedback. A busy batch that stays plain runs
# a plain group at every step, whose feedback (a model cost and a moving average, on caches
# the step's forward has just cleared) cost 21-25 µs of host time a step at 32 rows, a
# fifth of what a DFlash worker's plain step spent beyond a plain worker's. Plain steps
# come by the hundred and alike, so a moving average fed every 4th of them moves toward the
# same factor, in four times as many steps.
PLAIN_FEEDBACK_EVERY = 4


@dataclass
class StepProfile:
    """Seconds and forwards per kind of work: prefill, drafting groups, plain groups, and
    the catch-up of drafter context before a drafting group (cumulative)."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0.0))
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))

    def record(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += seconds
        self.counts[kind] += 1


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        dtype = torch_dtype(config.dtype)
        target = load_target(config.target_path, config.device, dtype)
        drafter = None
        if config.drafter_path is not None:
            drafter = load_drafter(config.drafter_path, target, config.device, dtype)
            if config.drafter_int8:
                if not (INT8_LINEAR and torch.device(config.device).type == "cpu"):
                    raise ValueError("drafter_int8: no int8 (fbgemm) matmuls for this device")
                drafter.use_int8()
        drafter_block = None if drafter is None else drafter.block_size
        self.block_size = block_size_for(config.num_speculative_tokens, drafter_block)
        if self.block_size == 1:
            drafter = None  # zero speculative tokens is plain decoding
        self.num_spec_tokens: int | None = None if drafter is None else self.block_size - 1
        self.drafter_kind: str | None = None if drafter is None else drafter.kind
        self.vocab_size: int = target.config.vocab_size
        self._state = SpecState.create(
            target,
            drafter,
            config.max_num_seqs,
            config.max_model_len,
            self.block_size,
            config.device,
            dtype,
        )
        self._sampling: dict[int, RowSampling] = {}  # by id(sequence), while it runs
        self._shared_generator = torch.Generator(device=config.device).manual_seed(config.seed)
        self.profile = StepProfile()
        self._last_decode = -math.inf  # perf_counter() at the end of the last decode step
        self._cold_steps = 0  # decode steps still to run before step costs are observed
        self._plain_groups = 0  # plain groups run (every PLAIN_FEEDBACK_EVERY-th is observed)
        self.policy: SpecPolicy | None = None
        self.planner: RowPlanner | None = None
        if config.adaptive and drafter is not None:
            # Measured now, while every slot is free (a few seconds).
            max_k = max_draft_tokens(self._state)
            self.policy = SpecPolicy(calibrate_state(self._state), max_k)
            self.planner = RowPlanner(self.policy, BandPriors(max_k))

    def add(self, seq: Sequence) -> None:
        """Set up a sequence's sampling (keyed by its seed when it has one)."""
        self._sampling[id(seq)] = self._row_sampling(seq)
        if self.planner is not None:
            self.planner.add(id(seq), seq.params.temperature)

    def remove(self, seq: Sequence) -> None:
        self._sampling.pop(id(seq), None)
        if self.planner is not None:
            self.planner.remove(id(seq))

    def free_slot(self, slot: int) -> None:
        release(self._state, slot)

    def move_slot(self, src: int, dst: int) -> None:
        move_slot(self._state, src, dst)

    def prefill(self, seqs: list[Sequence]) -> list[RowResult]:
        """Prompts into the caches; the first token of each sequence."""
        rows = [PrefillRow(slot=slot_of(s), token_ids=s.prompt_token_ids) for s in seqs]
        start = time.perf_counter()
        results = prefill(self._state, rows, [self._sampling[id(s)] for s in seqs])
        synchronize(self._state)
        self.profile.record("prefill", time.perf_counter() - start)
        return results

    def decode(self, seqs: list[Sequence]) -> list[RowResult]:
        """One speculative step over every running sequence. Adaptive: the rows split into
        a drafting group and a plain group (engine/row_speculation.py) by their own
        acceptance and the step's costs, one
        forward each; each group's time feeds the cost model (but for the first
        COLD_STEPS after the engine idled) and each row's acceptance its own estimates (the
        catch-up of context put off by plain steps is not charged to the group's k: the
        plan counts it from its own measure)."""
        rows = [
            DecodeRow(slot_of(s), s.last_token, s.position, s.prompt_token_ids, s.output_token_ids)
            for s in seqs
        ]
        sampling = [self._sampling[id(s)] for s in seqs]
        if self.policy is None:
            start = time.perf_counter()
            every = spec_step(self._state, rows, sampling)
            synchronize(self._state)
            kind = "drafting" if max_draft_tokens(self._state) else "plain"
            self.profile.record(kind, time.perf_counter() - start)
            return every
        if time.perf_counter() - self._last_decode > COLD_GAP_S:
            self._cold_steps = COLD_STEPS
        assert self.planner is not None
        keys = [id(s) for s in seqs]
        plan = self.planner.kept_plan(keys)
        if plan is None:
            plan = self._weigh(seqs, rows, keys)
        if not plan.any_drafting and _in_slot_order(rows):
            # Every row plain, in order: one forward as a plain worker's (most steps of a
            # busy batch), and only fades to observe.
            final = self._run_group(rows, sampling, 0)
            self.planner.observe_plain(keys)
        else:
            final = self._run_groups(seqs, rows, sampling, plan)
            self._observe(seqs, keys, final)
        self._cold_steps = max(0, self._cold_steps - 1)
        self._last_decode = time.perf_counter()
        return final

    def _run_groups(
        self,
        seqs: list[Sequence],
        rows: list[DecodeRow],
        sampling: list[RowSampling],
        plan: StepPlan,
    ) -> list[RowResult]:
        """The drafting group's forward, then the plain group's; each row's result."""
        if plan.any_drafting and not all(plan.drafting):
            rows = self._group_slots(seqs, rows, plan.drafting)
        results: list[RowResult | None] = [None] * len(rows)
        for k, members in ((plan.num_drafts, True), (0, False)):
            group = [i for i, drafting in enumerate(plan.drafting) if drafting == members]
            group.sort(key=lambda i: rows[i].slot)  # consecutive slots in order: views
            if group:
                done = self._run_group([rows[i] for i in group], [sampling[i] for i in group], k)
                for i, result in zip(group, done, strict=True):
                    results[i] = result
        return [r for r in results if r is not None]

    def _group_slots(
        self, seqs: list[Sequence], rows: list[DecodeRow], drafting: tuple[bool, ...]
    ) -> list[DecodeRow]:
        """Put the drafting group in the lowest of the rows' slots and the plain group in
        the others, exchanging caches where a row is on the wrong side. Each group is then
        consecutive slots (the scheduler keeps running slots consecutive), which a forward
        reads as views; scattered, it gathers (copies) every row's context at every layer.
        Groups change seldom (a row's estimates move slowly), so few steps exchange any."""
        slots = sorted(r.slot for r in rows)
        cut = slots[sum(drafting)]  # drafting rows belong below it, plain rows from it on
        high = [i for i, r in enumerate(rows) if drafting[i] and r.slot >= cut]
        low = [i for i, r in enumerate(rows) if not drafting[i] and r.slot < cut]
        rows = list(rows)
        for i, j in zip(high, low, strict=True):
            a, b = rows[i].slot, rows[j].slot
            swap_slots(self._state, a, b)
            seqs[i].slot, seqs[j].slot = b, a
            rows[i], rows[j] = replace(rows[i], slot=b), replace(rows[j], slot=a)
        return rows

    def _weigh(self, seqs: list[Sequence], rows: list[DecodeRow], keys: list[int]) -> StepPlan:
        assert self.planner is not None
        return self.planner.weigh(
            keys,
            [row.position for row in rows],
            lambda i: pending_context(self._state, [rows[i]]),
            [s.tokens_left for s in seqs],
        )

    def _run_group(
        self, rows: list[DecodeRow], sampling: list[RowSampling], k: int
    ) -> list[RowResult]:
        assert self.policy is not None
        if k > 0:
            start = time.perf_counter()
            if catch_up(self._state, rows):
                synchronize(self._state)  # its kernels are not this group's cost
                self.profile.record("catch_up", time.perf_counter() - start)
        start = time.perf_counter()
        results = spec_step(self._state, rows, sampling, num_draft=k)
        synchronize(self._state)
        seconds = time.perf_counter() - start
        self.profile.record("drafting" if k else "plain", seconds)
        if not k:
            self._plain_groups += 1
        if not self._cold_steps and (k or self._plain_groups % PLAIN_FEEDBACK_EVERY == 0):
            self.policy.observe_cost(len(rows), k, seconds, max(r.position for r in rows))
        return results

    def _observe(self, seqs: list[Sequence], keys: list[int], results: list[RowResult]) -> None:
        assert self.planner is not None
        self.planner.observe(
            keys,
            [s.params.temperature for s in seqs],
            [(r.num_drafted, r.num_accepted) for r in results],
        )

    def kv_cache_usage(self) -> float:
        return self._state.kv_cache_usage()

    def kv_cache_shape(self) -> KVCacheShape:
        return self._state.caches.target.shape()

    def _row_sampling(self, seq: Sequence) -> RowSampling:
        params = seq.params
        processors = _processors(seq)
        if params.temperature == 0:
            return RowSampling(
                0.0,
                processors=processors,
                logprobs=params.logprobs,
                prompt_logprobs=params.prompt_logprobs,
            )
        # A seeded row's draws are keyed by (seed, position) (sampling.keyed_token), so its
        # text holds whatever each step verifies; the others draw from the shared generator.
        return RowSampling(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            generator=self._shared_generator if params.seed is None else None,
            seed=params.seed,
            min_p=params.min_p,
            processors=processors,
            logprobs=params.logprobs,
            prompt_logprobs=params.prompt_logprobs,
        )


def _in_slot_order(rows: list[DecodeRow]) -> bool:
    """Whether the rows are consecutive slots in order (a forward then reads views)."""
    first = rows[0].slot
    return all(row.slot == first + i for i, row in enumerate(rows))


def _processors(seq: Sequence) -> LogitsProcessing | None:
    """The sequence's logits processors; None when it asks for none (the fast path)."""
    params: SamplingParams = seq.params
    proc = LogitsProcessing(
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        logit_bias=params.logit_bias,
        min_tokens=params.min_tokens,
        stop_token_ids=tuple(sorted(seq.min_tokens_stop_ids)),
        bad_words=seq.bad_words_token_ids,
        allowed_token_ids=params.allowed_token_ids,
    )
    return proc if proc.active else None
