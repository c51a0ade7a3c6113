"""The engine end to end on tiny random checkpoints: DFlash greedy == plain greedy under
continuous batching, queueing, cancellation, rejection, stop conditions, metrics, seeds."""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch

import engine.row_speculation as planning
import engine.runner as engine_runner
from engine.engine import Engine, EngineConfig
from engine.errors import RequestRejected
from engine.layers import INT8_LINEAR
from engine.loader import load_drafter, load_target, save_drafter, save_target
from engine.row_speculation import RowView, StepPlan
from engine.sequence import RequestOutput, SamplingParams, TokenLogprob
from engine.worker.formatting import metrics_object
from tests.fixtures.tiny_models import (
    TinyCheckpoint,
    build_tiny_checkpoint,
    make_agreeable,
    randomize,
)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny matmuls on a shared 2-core box: extra intra-op threads only spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """Block size 16, with a target far enough from a bigram model (body_scale 1) that
    drafts are accepted only in part (mean acceptance length ~1.7 at k=7) and outputs
    depend on positions and the whole context: every acceptance length gets exercised."""
    base = build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt16"), block_size=16)
    target = load_target(base.target_dir)
    drafter = load_drafter(base.drafter_dir, target)
    with torch.no_grad():
        randomize(target, seed=0)
        randomize(drafter, seed=1)
    make_agreeable(target, drafter, body_scale=1.0)
    save_target(target, base.target_dir)
    save_drafter(drafter, base.drafter_dir)
    return base


def make_engine(ckpt: TinyCheckpoint, k: int | None = None, **kw: object) -> Engine:
    """k None: plain decoding (no drafter); else DFlash with k speculative tokens."""
    config = EngineConfig(
        target_path=ckpt.target_dir,
        drafter_path=None if k is None else ckpt.drafter_dir,
        num_speculative_tokens=k,
        max_num_seqs=4,
        max_model_len=128,
    )
    return Engine(replace(config, **kw))  # type: ignore[arg-type]


def random_requests(seed: int, n: int, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(vocab) for _ in range(rng.randint(1, 40))],
            replace(GREEDY, max_tokens=rng.randint(1, 24)),
        )
        for _ in range(n)
    ]


def run(
    engine: Engine,
    requests: list[tuple[list[int], SamplingParams]],
    join_at: list[int] | None = None,
) -> dict[str, RequestOutput]:
    """Drive `step()` directly; request i joins at step join_at[i]. Returns the final
    output of each request with the whole token list in token_ids_delta (and the whole
    logprobs list in logprobs_delta)."""
    join_at = join_at or [0] * len(requests)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprob]] = {}
    final: dict[str, RequestOutput] = {}
    for step in range(10_000):
        for i, (prompt, params) in enumerate(requests):
            if join_at[i] == step:
                engine.add_request(str(i), prompt, params)
        for _, out in engine.step():
            rid = out.request_id
            tokens.setdefault(rid, []).extend(out.token_ids_delta)
            if out.logprobs_delta is not None:
                logprobs.setdefault(rid, []).extend(out.logprobs_delta)
            if out.finished:
                whole = None if out.logprobs_delta is None else logprobs.get(rid, [])
                final[rid] = replace(out, token_ids_delta=tokens[rid], logprobs_delta=whole)
        if len(final) == len(requests) and step >= max(join_at):
            return final
    raise AssertionError("engine did not finish")


@pytest.fixture(scope="module")
def requests(ckpt: TinyCheckpoint) -> list[tuple[list[int], SamplingParams]]:
    return random_requests(0, 16, make_engine(ckpt).vocab_size)


@pytest.fixture(scope="module")
def reference(
    ckpt: TinyCheckpoint, requests: list[tuple[list[int], SamplingParams]]
) -> dict[str, list[int]]:
    """Plain greedy decoding, one request at a time: the oracle."""
    engine = make_engine(ckpt, max_num_seqs=1)
    out = run(engine, requests, join_at=[i * 200 for i in range(len(requests))])
    return {rid: o.token_ids_delta for rid, o in out.items()}


def test_an_engine_says_what_it_decodes_with(ckpt: TinyCheckpoint) -> None:
    """The worker's ready line: the drafter's kind and folder, its drafts and its policy."""
    assert make_engine(ckpt).describe() == "plain decoding"
    assert make_engine(ckpt, 7, adaptive=True).describe() == (
        f"DFlash drafter {ckpt.drafter_dir}, up to 7 drafts a step (k chosen per step)"
    )


def test_plain_batched_matches_plain_alone(
    ckpt: TinyCheckpoint,
    requests: list[tuple[list[int], SamplingParams]],
    reference: dict[str, list[int]],
) -> None:
    out = run(
        make_engine(ckpt), requests, join_at=[0, 0, 0, 1, 2, 2, 5, 6, 9, 9, 9, 12, 13, 13, 20, 30]
    )
    assert {rid: o.token_ids_delta for rid, o in out.items()} == reference


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_dflash_greedy_equals_plain_greedy(
    ckpt: TinyCheckpoint,
    requests: list[tuple[list[int], SamplingParams]],
    reference: dict[str, list[int]],
    block_size: int,
) -> None:
    engine = make_engine(ckpt, k=block_size - 1)
    assert engine.block_size == block_size
    # Unbatched, then batched with requests joining mid-run (4 slots, 16 requests).
    alone = run(engine, requests[:3], join_at=[0, 100, 200])
    for rid, o in alone.items():
        assert o.token_ids_delta == reference[rid], f"request {rid} alone"
    rng = random.Random(block_size)
    join_at = sorted(rng.randrange(12) for _ in requests)
    batched = run(engine, requests, join_at=join_at)
    for rid, o in batched.items():
        assert o.token_ids_delta == reference[rid], f"request {rid} batched"
        assert o.finish_reason == "length"
    stats = engine.stats()
    assert stats.num_accepted_tokens > 0  # the agreeable drafter's drafts were used
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_leaving_mid_run_changes_nothing_for_the_others(
    ckpt: TinyCheckpoint,
    requests: list[tuple[list[int], SamplingParams]],
    reference: dict[str, list[int]],
) -> None:
    engine = make_engine(ckpt, k=3, max_num_seqs=3)
    seqs = [engine.add_request(str(i), p, s) for i, (p, s) in enumerate(requests[:6])]
    tokens: dict[str, list[int]] = {}
    finished: dict[str, str | None] = {}
    for step in range(500):
        if step == 2:
            engine.abort(seqs[1])  # running
            engine.abort(seqs[5])  # still waiting
        for _, out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids_delta)
            if out.finished:
                finished[out.request_id] = out.finish_reason
        if len(finished) == 6:
            break
    assert finished["1"] == "abort" and finished["5"] == "abort"
    for rid in ("0", "2", "3", "4"):
        assert finished[rid] == "length" and tokens[rid] == reference[rid]


def test_full_slots_queue_instead_of_failing(ckpt: TinyCheckpoint) -> None:
    engine = make_engine(ckpt, k=3, max_num_seqs=2, max_waiting=8)
    for i in range(6):
        engine.add_request(str(i), [5 + i, 6, 7], GREEDY)
    engine.step()
    stats = engine.stats()
    assert stats.num_running == 2 and stats.num_waiting == 4
    assert 0 < stats.kv_cache_usage < 1
    while engine.stats().num_running or engine.stats().num_waiting:
        engine.step()
    assert engine.stats().num_requests_finished == 6
    assert engine.stats().kv_cache_usage == 0


def test_stop_strings_and_stop_token_ids(ckpt: TinyCheckpoint) -> None:
    engine = make_engine(ckpt, k=7)
    prompt = [11, 12, 13, 14]
    ref = run(engine, [(prompt, replace(GREEDY, max_tokens=24))])["0"]
    text = engine.tokenizer.decode(ref.token_ids_delta)
    assert len(text) > 8
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    got = run(engine, [(prompt, replace(GREEDY, max_tokens=24, stop=(stop,)))])["0"]
    assert got.finish_reason == "stop"
    assert engine.tokenizer.decode(got.token_ids_delta).startswith(text[: text.index(stop)])
    assert len(got.token_ids_delta) < len(ref.token_ids_delta)

    tok = ref.token_ids_delta[6]
    cut = ref.token_ids_delta.index(tok)
    got = run(engine, [(prompt, replace(GREEDY, max_tokens=24, stop_token_ids=(tok,)))])["0"]
    assert got.finish_reason == "stop" and got.token_ids_delta == ref.token_ids_delta[: cut + 1]


def test_context_limit_is_length(ckpt: TinyCheckpoint) -> None:
    """No max_tokens: the request runs to the context limit, even inside a speculated block."""
    engine = make_engine(ckpt, k=15, max_model_len=32)
    out = run(engine, [(list(range(3, 31)), replace(GREEDY, max_tokens=None))])["0"]
    assert out.finish_reason == "length" and len(out.token_ids_delta) == 4


def test_context_rules_are_vllms(ckpt: TinyCheckpoint) -> None:
    """max_tokens over the context and prompts that fill it are refused; a prompt plus
    max_tokens past the limit runs to the limit ("length"), as vLLM serves it."""
    engine = make_engine(ckpt, max_model_len=32)
    with pytest.raises(RequestRejected) as err:
        engine.add_request("a", [3, 4], replace(GREEDY, max_tokens=33))
    assert err.value.param == "max_tokens" and err.value.code == "context_length_exceeded"
    assert "max_tokens=33 cannot be greater than max_model_len=32" in err.value.message
    with pytest.raises(RequestRejected) as err:
        engine.add_request("b", list(range(3, 35)), GREEDY)
    assert err.value.param == "prompt" and "maximum context length is 32" in err.value.message
    out = run(engine, [(list(range(3, 31)), replace(GREEDY, max_tokens=20))])["0"]
    assert out.finish_reason == "length" and len(out.token_ids_delta) == 4


def test_speculation_metrics_add_up(ckpt: TinyCheckpoint) -> None:
    engine = make_engine(ckpt, k=7)
    reqs = random_requests(5, 6, engine.vocab_size)
    out = run(engine, reqs)
    steps = drafted = accepted = 0
    for o in out.values():
        m = metrics_object(o.metrics, "detailed", stream=False)
        sd = m["speculative_decoding"]
        assert sum(sd["acceptance_histogram"]) == sd["num_spec_steps"]
        assert len(sd["acceptance_histogram"]) == 8 and sd["num_spec_tokens"] == 7
        assert sd["num_accepted_draft_tokens"] <= sd["num_draft_tokens"]
        assert sd["num_draft_tokens"] == 7 * sd["num_spec_steps"]
        assert sum(sd["per_step_accepted"]) == sd["num_accepted_draft_tokens"]
        if sd["num_spec_steps"]:
            assert sd["mean_acceptance_length"] == pytest.approx(
                1 + sd["num_accepted_draft_tokens"] / sd["num_spec_steps"]
            )
        # 1 token from prefill, then at most accepted + 1 per verify step.
        assert o.num_output_tokens <= 1 + sd["num_spec_steps"] + sd["num_accepted_draft_tokens"]
        assert m["time_to_first_token_ms"] >= 0 and m["queue_time_ms"] >= 0
        assert m["tokens_per_second"] > 0
        steps += sd["num_spec_steps"]
        drafted += sd["num_draft_tokens"]
        accepted += sd["num_accepted_draft_tokens"]
    stats = engine.stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (
        steps,
        drafted,
        accepted,
    )
    assert sum(stats.accepted_per_pos) == accepted and len(stats.accepted_per_pos) == 7
    assert all(a >= b for a, b in pairwise(stats.accepted_per_pos))
    assert stats.generation_tokens == sum(o.num_output_tokens for o in out.values())
    assert stats.prompt_tokens == sum(len(p) for p, _ in reqs)


def test_plain_engine_reports_no_speculation(ckpt: TinyCheckpoint) -> None:
    engine = make_engine(ckpt)
    out = run(engine, [([4, 5, 6], GREEDY)])["0"]
    assert "speculative_decoding" not in metrics_object(out.metrics, "summary", stream=False)
    assert engine.stats().num_spec_tokens == 0 and engine.stats().accepted_per_pos == []


@pytest.mark.parametrize("k", [None, 3])
def test_seeded_sampling_is_reproducible(ckpt: TinyCheckpoint, k: int | None) -> None:
    def sample(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
        return run(make_engine(ckpt, k=k), [([7, 8, 9], params)])["0"].token_ids_delta

    first = sample(7)
    assert sample(7) == first
    assert any(sample(s) != first for s in (8, 9, 10))
    # The seed owns its randomness: unseeded sampled neighbours joining mid-run change nothing.
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    noisy = SamplingParams(max_tokens=9, temperature=0.9, top_k=50, ignore_eos=True)
    reqs = [([1, 2], noisy), ([7, 8, 9], seeded), ([3, 4, 5, 6], noisy)]
    out = run(make_engine(ckpt, k=k), reqs, join_at=[0, 1, 3])
    assert out["1"].token_ids_delta == first


def _prefer(k: int, policy: object, rows: list[RowView]) -> StepPlan:
    """A plan that drafts k for every row (k = 0: none), whatever the estimates say."""
    return StepPlan(k, (k > 0,) * len(rows))


@pytest.mark.parametrize("preferred", [0, 1, 3, 15])
def test_a_seeded_text_is_the_same_whatever_the_plan_drafts(
    ckpt: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, preferred: int
) -> None:
    """A seeded sampled request is planned like any other (it drafts what the plan gives
    it, here 0, 1, 3 or 15 drafts a step, beside a greedy neighbour): its draws are keyed by
    position, so its text is the plain engine's for the same seed, token for token."""
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reqs = [([1, 2], greedy), ([7, 8, 9], seeded)]
    expected = run(make_engine(ckpt), reqs, join_at=[0, 2])["1"].token_ids_delta
    engine = make_engine(ckpt, k=15, adaptive=True)
    monkeypatch.setattr(planning, "plan_step", functools.partial(_prefer, preferred))
    monkeypatch.setattr(planning, "explored", lambda policy, plan, rows: plan)
    monkeypatch.setattr(planning, "probed", lambda policy, plan, rows: plan)
    out = run(engine, reqs, join_at=[0, 2])
    assert out["1"].token_ids_delta == expected
    steps = engine.stats().steps_by_k
    others = [count for k, count in enumerate(steps) if k != preferred]
    assert steps[preferred] > 0 and not any(others), steps  # the plan ran as given


def test_seeded_sampling_is_lossless_at_every_draft_length(ckpt: TinyCheckpoint) -> None:
    """Fixed k = 1, 3 and 15, seeded, at several temperatures and a top-k: the text is the
    plain engine's for every seed (tests/engine/train/test_bundled.py shows drafts accepted
    on the same path, with a trained drafter)."""
    params = [
        SamplingParams(max_tokens=24, temperature=t, top_k=k, seed=s, ignore_eos=True)
        for s, (t, k) in enumerate([(0.2, 0), (0.2, 20), (0.5, 0), (1.0, 0)])
    ]
    plain = make_engine(ckpt)
    prompts = [prompt for prompt, _ in random_requests(5, 4, plain.vocab_size)]
    reqs = list(zip(prompts, params, strict=True))
    expected = run(plain, reqs)
    for k in (1, 3, 15):
        out = run(make_engine(ckpt, k=k), reqs)
        for rid in expected:
            assert out[rid].token_ids_delta == expected[rid].token_ids_delta, (k, rid)


def test_sampled_traffic_leaves_the_next_greedy_request_its_own_estimates(
    ckpt: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four sampled requests, then a greedy one: the greedy request is planned from its
    own band's prior (what a fresh worker gives it), not from what sampled traffic left,
    and the sampled requests' own estimates went down as drafts failed."""
    seen: list[list[list[float]]] = []
    real_plan = planning.plan_step

    def spy(policy: object, rows: list[RowView]) -> StepPlan:
        seen.append([list(r.rates) for r in rows])
        return real_plan(policy, rows)  # type: ignore[arg-type]

    monkeypatch.setattr(planning, "plan_step", spy)
    engine = make_engine(ckpt, k=3, adaptive=True)
    prior = engine.runner.planner.priors.stats_for(0.0)  # type: ignore[union-attr]
    fresh = prior.optimistic_rates(planning.OPTIMISM)  # what the plan weighs
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=None, ignore_eos=True)
    run(engine, [([5, 6, 7], sampled)] * 4)
    assert seen and any(rates[0] < fresh[0] for step in seen for rates in step)
    seen.clear()
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    run(engine, [([1, 2, 3], greedy)])
    assert seen[0] == [fresh]


def test_num_speculative_tokens_is_checked(ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_engine(ckpt, k=16)
    with pytest.raises(ValueError, match="needs a drafter"):
        make_engine(ckpt, num_speculative_tokens=3)


def test_reference_matches_transformers_greedy(
    ckpt: TinyCheckpoint,
    requests: list[tuple[list[int], SamplingParams]],
    reference: dict[str, list[int]],
) -> None:
    """The oracle itself, against an independent implementation: HF Qwen3 recomputing the
    whole sequence for every token (no cache), so a position or cache bug shared by the
    plain and DFlash paths cannot hide."""
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(ckpt.target_dir, dtype=torch.float32).eval()
    for i in (0, 3, 7):
        prompt, params = requests[i]
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(params.max_tokens):
                logits = hf(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
        assert ids[len(prompt) :] == reference[str(i)], f"request {i}"


def test_adaptive_speculation_is_lossless_and_counts_its_choices(
    ckpt: TinyCheckpoint,
    requests: list[tuple[list[int], SamplingParams]],
    reference: dict[str, list[int]],
) -> None:
    engine = make_engine(ckpt, k=15, adaptive=True)
    assert engine.runner.policy is not None  # calibrated at construction
    out = run(engine, requests, join_at=[0, 0, 1, 1, 2, 3, 5, 8, 8, 9, 9, 12, 13, 13, 20, 30])
    assert {rid: o.token_ids_delta for rid, o in out.items()} == reference
    stats = engine.stats()
    assert len(stats.steps_by_k) == 16 and sum(stats.steps_by_k) > 0
    # Only steps that verified drafts count as vLLM's drafts.
    assert stats.num_drafts == sum(stats.steps_by_k[1:])
    spec = next(iter(out.values())).metrics.spec
    assert spec is not None and spec.adaptive
    assert spec.num_plain_steps + len(spec.per_step_drafted) >= 1


# ---- logits processors and logprobs: exact under speculation -----------------------------
# On the bundled trained pair: real text, a drafter that agrees often (so speculation is
# really exercised), real words for bad_words.

BUNDLED = Path(__file__).resolve().parents[2] / "engine/assets/tiny-coder"
CODE_PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "Write a Python function that reverses a string.",
    "import os\n\ndef list_files(path):",
]
BASE = SamplingParams(max_tokens=32, temperature=0.0)


def bundled_engine(k: int | None, **kw: Any) -> Engine:
    return Engine(
        EngineConfig(
            target_path=BUNDLED / "target",
            drafter_path=None if k is None else BUNDLED / "dflash",
            num_speculative_tokens=k,
            max_num_seqs=4,
            max_model_len=512,
            **kw,
        )
    )


@pytest.fixture(scope="module")
def code_prompts() -> list[list[int]]:
    tok = bundled_engine(None).tokenizer
    return [tok.encode(text) for text in CODE_PROMPTS]


def _outputs(
    engine: Engine, prompts: list[list[int]], params: SamplingParams
) -> dict[str, RequestOutput]:
    return run(engine, [(p, params) for p in prompts], join_at=[0, 0, 1, 3])


def _processor_cases(base: list[int]) -> dict[str, SamplingParams]:
    """Each processor (and all together), aimed at the plain greedy output `base` of the
    first prompt so that each visibly changes it."""
    stop = base[2]
    return {
        "repetition_penalty": replace(BASE, repetition_penalty=1.3),
        "frequency_penalty": replace(BASE, frequency_penalty=0.5),
        "presence_penalty": replace(BASE, presence_penalty=0.5),
        "logit_bias": replace(BASE, logit_bias=((base[1], -100.0), (base[5], 3.0))),
        "min_tokens": replace(BASE, stop_token_ids=(stop,), min_tokens=8),
        "bad_words": replace(BASE, bad_words=("self", "name")),
        "allowed_token_ids": replace(BASE, allowed_token_ids=tuple(range(0, 4096, 2))),
        "all of them": replace(
            BASE,
            repetition_penalty=1.1,
            frequency_penalty=0.2,
            presence_penalty=0.2,
            logit_bias=((base[5], 2.0),),
            stop_token_ids=(stop,),
            min_tokens=5,
            bad_words=("return",),
            logprobs=3,
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "min_tokens",
        "bad_words",
        "allowed_token_ids",
        "all of them",
    ],
)
def test_logits_processors_are_exact_under_speculation(
    code_prompts: list[list[int]], case: str
) -> None:
    """Greedy with each processor: DFlash (3 and 15 drafts per step, batched, joining
    mid-run) gives plain decoding's tokens, and the processor did change them."""
    plain = bundled_engine(None)
    base = _outputs(plain, code_prompts, BASE)
    params = _processor_cases(base["0"].token_ids_delta)[case]
    expected = _outputs(plain, code_prompts, params)
    assert any(expected[r].token_ids_delta != base[r].token_ids_delta for r in expected), (
        f"{case} changed nothing: the test is vacuous"
    )
    for k in (3, 15):
        engine = bundled_engine(k)
        got = _outputs(engine, code_prompts, params)
        for rid, out in expected.items():
            assert got[rid].token_ids_delta == out.token_ids_delta, f"{case}, k={k}, request {rid}"
            assert got[rid].finish_reason == out.finish_reason
            _same_logprobs(got[rid].logprobs_delta, out.logprobs_delta)
        assert engine.stats().num_accepted_tokens > 0, "no draft accepted: the test is vacuous"


def test_split_steps_exchange_slots_and_stay_lossless(
    code_prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Odd requests draft, even ones run plain: the drafting group is moved into the lowest
    slots (caches exchanged) so each group is consecutive, and the text is plain decoding's."""
    expected = _outputs(bundled_engine(None), code_prompts, BASE)
    engine = bundled_engine(15, adaptive=True)
    assert engine.runner.planner is not None

    def odd_requests_draft(keys: Any, *rest: Any) -> StepPlan:
        names = {id(s): int(s.request_id) for s in engine._scheduler.running.values()}
        return StepPlan(3, tuple(names[k] % 2 == 1 for k in keys))

    swaps: list[tuple[int, int]] = []
    exchange = engine_runner.swap_slots

    def counted(state: Any, a: int, b: int) -> None:
        swaps.append((a, b))
        exchange(state, a, b)

    monkeypatch.setattr(engine.runner.planner, "kept_plan", lambda keys: None)
    monkeypatch.setattr(engine.runner.planner, "weigh", odd_requests_draft)
    monkeypatch.setattr(engine_runner, "swap_slots", counted)
    got = _outputs(engine, code_prompts, BASE)
    assert {rid: o.token_ids_delta for rid, o in got.items()} == {
        rid: o.token_ids_delta for rid, o in expected.items()
    }
    assert swaps, "no step exchanged slots"
    assert engine.stats().num_accepted_tokens > 0


def test_an_int8_drafter_changes_drafts_not_outputs(code_prompts: list[list[int]]) -> None:
    """drafter_int8: the drafter's matmuls (its borrowed lm_head included) in int8; greedy
    output stays plain decoding's, drafts still land, and the target's own lm_head stays
    float (its logprobs are unchanged)."""
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2)
    expected = _outputs(bundled_engine(None), code_prompts, params)
    engine = bundled_engine(15, drafter_int8=True)
    drafter = engine.runner._state.drafter
    assert drafter is not None and drafter.int8 == INT8_LINEAR
    got = _outputs(engine, code_prompts, params)
    for rid, out in expected.items():
        assert got[rid].token_ids_delta == out.token_ids_delta, f"request {rid}"
        _same_logprobs(got[rid].logprobs_delta, out.logprobs_delta)
    stats = engine.stats()
    assert stats.num_accepted_tokens > stats.num_drafts, "drafts hardly accepted"


def test_an_int8_drafter_without_int8_kernels_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("engine.runner.INT8_LINEAR", False)
    with pytest.raises(ValueError, match="drafter_int8"):
        bundled_engine(15, drafter_int8=True)


def _same_logprobs(got: list[TokenLogprob] | None, want: list[TokenLogprob] | None) -> None:
    """Equal up to float rounding (a verify step and a plain step sum in different orders)."""
    assert (got is None) == (want is None)
    for g, w in zip(got or [], want or [], strict=True):
        assert (g.token_id, g.rank) == (w.token_id, w.rank)
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert [g.logprob, *(v for _, v in g.top)] == pytest.approx(
            [w.logprob, *(v for _, v in w.top)], abs=1e-4
        )


def _teacher_forced(prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of the target's logits at each output position, in one plain forward."""
    target = load_target(BUNDLED / "target")
    ids = torch.tensor([prompt + output[:-1]])
    with torch.no_grad():
        logits = target(ids, torch.arange(ids.shape[1])[None]).logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("k", [None, 15])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_targets_at_each_emitted_token(
    code_prompts: list[list[int]], k: int | None, temperature: float
) -> None:
    """Greedy and seeded sampling, with and without speculation: each token's logprob, rank
    and top-5 are the target's own (raw: before the penalty) at that position."""
    params = replace(
        BASE, temperature=temperature, seed=3, logprobs=5, repetition_penalty=1.2, max_tokens=20
    )
    outs = _outputs(bundled_engine(k), code_prompts, params)
    for rid, out in outs.items():
        tokens, entries = out.token_ids_delta, out.logprobs_delta
        assert entries is not None and [e.token_id for e in entries] == tokens
        expected = _teacher_forced(code_prompts[int(rid)], tokens)
        for i, e in enumerate(entries):
            assert e.logprob == pytest.approx(float(expected[i, tokens[i]]), abs=1e-4)
            # the rank up to float ties: tokens within 1e-5 of this one may fall either side
            own = expected[i, tokens[i]]
            above, tied = (
                int((expected[i] > own + 1e-5).sum()),
                int((expected[i] >= own - 1e-5).sum()),
            )
            assert above + 1 <= e.rank <= tied
            top = expected[i].topk(5)
            assert [t for t, _ in e.top] == top.indices.tolist()
            assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_prompt_logprobs_are_the_targets_over_the_prompt(code_prompts: list[list[int]]) -> None:
    """What `echo` with `logprobs` returns: each prompt token after the first, scored by the
    target on the tokens before it (prompts prefilled together, padded to the longest)."""
    params = replace(BASE, max_tokens=2, prompt_logprobs=2)
    engine = bundled_engine(15)
    for i, prompt in enumerate(code_prompts):
        engine.add_request(str(i), prompt, params if i != 1 else BASE)
    firsts: dict[str, RequestOutput] = {}
    while engine.has_work:
        for _, out in engine.step():
            firsts.setdefault(out.request_id, out)
    assert firsts["1"].prompt_logprobs is None  # not asked for
    for rid in ("0", "2", "3"):
        prompt, entries = code_prompts[int(rid)], firsts[rid].prompt_logprobs
        assert entries is not None and [e.token_id for e in entries] == prompt[1:]
        expected = _teacher_forced(prompt[:1], [*prompt[1:], 0])  # logits after each token
        for j, e in enumerate(entries):
            assert e.logprob == pytest.approx(float(expected[j, prompt[j + 1]]), abs=1e-4)
            assert [t for t, _ in e.top] == expected[j].topk(2).indices.tolist()
