"""DFlash2 drafter: the convolution and the selector against loop references written here
from the formulas (float64), cached == cache-free forward, save/load, refusals at load
naming the key, and the engine with a DFlash2 drafter: lossless greedy (fixed and
adaptive), reproducible seeded sampling, logprobs."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.dflash2 import DFlash2Config, DFlash2Drafter, grouped_conv
from engine.engine import Engine, EngineConfig
from engine.loader import CheckpointError, load_drafter, load_target, save_drafter
from engine.sequence import SamplingParams
from tests.engine.test_engine import GREEDY, random_requests, run
from tests.fixtures.tiny_dflash2 import build_tiny_dflash2_checkpoint, random_dflash2_drafter
from tests.fixtures.tiny_models import TinyCheckpoint, random_target, tiny_target_config


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- references, straight from the formulas ---------------------------------------------


def reference_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """x [B, H], delta [B, T, G], base [T, H]: out[t, c] = sum_{k <= t} (base[k, c] +
    delta[t, k, g(c)]) * x[t - k, c], one element at a time in float64."""
    size, hidden = x.shape
    taps, groups = delta.shape[1:]
    per_group = hidden // groups
    out = torch.zeros(size, hidden, dtype=torch.float64)
    for t in range(size):
        for c in range(hidden):
            for k in range(taps):
                if t >= k:
                    coefficient = float(base[k, c]) + float(delta[t, k, c // per_group])
                    out[t, c] += coefficient * float(x[t - k, c])
    return out


@torch.no_grad()
def reference_path(
    drafter: DFlash2Drafter, anchor: int, hidden: torch.Tensor
) -> tuple[list[int], list[list[int]]]:
    """One row: hidden [B, H] after the final norm -> (the walked path, each mask row's
    candidates), every score summed term by term in float64."""
    extra = drafter.dflash2
    head = drafter._borrowed[1].weight.double()
    selector = drafter.candidate_selector
    pred = selector.predecessor_codebook.double()
    succ = selector.successor_codebook.double()
    proj = selector.hidden_projection.weight.double()
    path, candidates, previous = [], [], None
    for row in range(1, hidden.shape[0]):
        h = hidden[row].double()
        logits = head @ h
        order = sorted(range(len(logits)), key=lambda v: -float(logits[v]))
        ids = order[: extra.selector_top_k]
        candidates.append(ids)
        hp = [float(proj[r] @ h) for r in range(proj.shape[0])]
        before = anchor if previous is None else previous
        best, best_score = -1, float("-inf")
        for c in ids:
            unary = float(logits[c]) * extra.output_multiplier  # then the cap (vLLM's order)
            if extra.final_logit_softcapping > 0:
                cap = extra.final_logit_softcapping
                unary = cap * float(torch.tanh(torch.tensor(unary / cap, dtype=torch.float64)))
            pair = sum(float(pred[before, r]) * hp[r] * float(succ[c, r]) for r in range(len(hp)))
            if unary + pair > best_score:
                best, best_score = c, unary + pair
        path.append(best)
        previous = best
    return path, candidates


def _pair(extra: DFlash2Config, block_size: int = 8, seed: int = 3) -> DFlash2Drafter:
    target = random_target(tiny_target_config(48, 4), seed=seed)
    return random_dflash2_drafter(target, block_size=block_size, extra=extra, seed=seed + 1)


EXTRAS = [
    DFlash2Config(3, 4, 4, 4),
    # taps beyond the block (never reach a row), a cap and a multiplier, an embedding scale
    DFlash2Config(11, 8, 3, 6, 1.7, 0.8, 2.5),
    DFlash2Config(1, 32, 2, 1),  # one tap, one group, top-1 (the walk is the argmax)
]


@pytest.mark.parametrize("extra", EXTRAS)
def test_grouped_conv_matches_the_formula(extra: DFlash2Config) -> None:
    drafter = _pair(extra).double()
    conv = drafter.dflash2_layers()[0].attention_conv
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 32, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        out, delta = conv.prepare(x)
        finished = conv.finish(x, delta)
        deltas = conv.kernel_projection(x).view(2, 8, 2, extra.conv_kernel_size, -1)
    base = conv.base_kernel.detach()
    for b in range(2):
        assert torch.allclose(out[b], reference_conv(x[b], deltas[b, :, 0], base[0]), atol=1e-12)
        assert torch.allclose(
            finished[b], reference_conv(x[b], deltas[b, :, 1], base[1]), atol=1e-12
        )
    # float32, as served: the free function agrees with the formula to rounding
    out32 = grouped_conv(x.float(), deltas[:, :, 0].float(), base[0].float())
    assert torch.allclose(out32.double(), out, atol=1e-5)


@pytest.mark.parametrize("extra", EXTRAS)
def test_selector_path_matches_the_formula(extra: DFlash2Config) -> None:
    drafter = _pair(extra)
    with torch.no_grad():  # pairwise terms large enough to overturn the argmax at times
        drafter.candidate_selector.predecessor_codebook.mul_(3.0)
        drafter.candidate_selector.successor_codebook.mul_(3.0)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(16, 8, 32, generator=gen)
    anchors = torch.randint(0, 48, (16,), generator=gen)
    with torch.no_grad():
        proposed = drafter.propose(anchors, hidden).tolist()
        argmax = drafter.logits(hidden[:, 1:]).argmax(-1).tolist()
    for i in range(16):
        path, candidates = reference_path(drafter, int(anchors[i]), hidden[i])
        assert proposed[i] == path, f"row {i}"
        assert all(token in ids for token, ids in zip(path, candidates, strict=True))
    if extra.selector_top_k == 1:
        assert proposed == argmax
    else:  # the selector changed some proposals (the test is not the argmax's)
        assert proposed != argmax


@torch.no_grad()
def reference_hidden(
    drafter: DFlash2Drafter,
    ids: torch.Tensor,
    positions: torch.Tensor,
    features: torch.Tensor,
    ctx_positions: torch.Tensor,
) -> torch.Tensor:
    """The layer order from the formulas, float64 (attention from the engine's own tested
    Qwen3 pieces): x += finish(attn(prepare(norm(x)))); x += finish(mlp(prepare(norm(x))))."""
    d = drafter.double()

    def rms(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def conv(v: torch.Tensor, deltas: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        return torch.stack([reference_conv(v[b], deltas[b], base) for b in range(v.shape[0])])

    x = d._borrowed[0].weight.double()[ids] * d.dflash2.input_embedding_scale
    ctx = rms(features.double() @ d.fc.weight.T, d.hidden_norm.weight)
    cos, sin = d.rotary.cos_sin(positions, torch.float64)
    ccos, csin = d.rotary.cos_sin(ctx_positions, torch.float64)
    b, size, _ = x.shape
    for layer in d.dflash2_layers():
        attn, convs = layer.self_attn, (layer.attention_conv, layer.mlp_conv)
        h = rms(x, layer.input_layernorm.weight)
        deltas = (h @ convs[0].kernel_projection.weight.T).view(b, size, 2, convs[0].taps, -1)
        h = conv(h, deltas[:, :, 0], convs[0].base_kernel[0])
        ck, cv = attn.key_value(ctx, ccos, csin)
        k, v = attn.key_value(h, cos, sin)
        a = attn.attend(attn.query(h, cos, sin), torch.cat([ck, k], 2), torch.cat([cv, v], 2), None)
        x = x + conv(a, deltas[:, :, 1], convs[0].base_kernel[1])
        h = rms(x, layer.post_attention_layernorm.weight)
        deltas = (h @ convs[1].kernel_projection.weight.T).view(b, size, 2, convs[1].taps, -1)
        h = conv(h, deltas[:, :, 0], convs[1].base_kernel[0])
        x = x + conv(layer.mlp(h), deltas[:, :, 1], convs[1].base_kernel[1])
    return rms(x, d.norm.weight)


def test_hidden_states_match_the_formula_cached_and_cache_free() -> None:
    extra = EXTRAS[1]
    drafter = _pair(extra)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 48, (2, 8), generator=gen)
    positions = torch.arange(5, 13)[None].expand(2, 8)
    features = torch.randn(2, 5, drafter.fc.in_features, generator=gen) * 0.5
    ctx_positions = torch.arange(5)[None].expand(2, 5)
    with torch.no_grad():
        free = drafter(ids, positions, features, ctx_positions)
        cache = drafter.new_cache(2, 32, "cpu", torch.float32)
        slots = torch.tensor([0, 1])
        drafter.append_context(features, ctx_positions, None, cache, slots)
        cached = drafter.draft_hidden(ids, positions, cache, slots, torch.tensor([5, 5]))
        expected = reference_hidden(drafter, ids, positions, features, ctx_positions)
    assert torch.allclose(free.double(), expected, atol=1e-4)
    assert torch.allclose(cached, free, atol=1e-5)
    print("max |ours - reference|", float((free.double() - expected).abs().max()))


# ---- checkpoints --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    return build_tiny_dflash2_checkpoint(tmp_path_factory.mktemp("dflash2"))


def test_checkpoint_layout_and_round_trip(ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    config = json.loads((ckpt.drafter_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"} <= set(
        config["dflash_config"]
    )
    weights = load_file(str(ckpt.drafter_dir / "model.safetensors"))
    assert weights["layers.0.attention_conv.base_kernel"].shape == (2, 3, 32)
    assert weights["layers.0.mlp_conv.kernel_projection.weight"].shape == (2 * 3 * 8, 32)
    assert weights["candidate_selector.predecessor_codebook"].shape == (config["vocab_size"], 4)
    assert weights["candidate_selector.hidden_projection.weight"].shape == (4, 32)
    target = load_target(ckpt.target_dir)
    drafter = load_drafter(ckpt.drafter_dir, target)
    assert isinstance(drafter, DFlash2Drafter) and drafter.kind == "DFlash2"
    save_drafter(drafter, tmp_path)
    again = load_file(str(tmp_path / "model.safetensors"))
    assert again.keys() == weights.keys()
    assert all(torch.equal(again[k], weights[k]) for k in weights)


def _edited(ckpt: TinyCheckpoint, tmp_path: Path, **changes: object) -> Path:
    out = tmp_path / "edited"
    shutil.copytree(ckpt.drafter_dir, out)
    config = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if key in ("block_size",):
            config[key] = value
        elif value is None:
            config["dflash_config"].pop(key)
        else:
            config["dflash_config"][key] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"conv_kernel_size": 4}, "layers.0.attention_conv.base_kernel"),
        ({"conv_group_size": 8}, "layers.0.attention_conv.kernel_projection.weight"),
        ({"conv_group_size": 5}, "dflash_config.conv_group_size"),
        ({"conv_kernel_size": 0}, "dflash_config.conv_kernel_size"),
        ({"selector_top_k": 0}, "dflash_config.selector_top_k"),
        ({"selector_top_k": 10**6}, "dflash_config.selector_top_k"),
        ({"selector_rank": None}, "dflash_config.selector_rank"),
        ({"selector_rank": 5}, "candidate_selector.predecessor_codebook"),
        ({"block_size": 1}, "block_size"),
    ],
)
def test_a_bad_config_is_refused_naming_the_key(
    ckpt: TinyCheckpoint, tmp_path: Path, changes: dict[str, object], named: str
) -> None:
    bad = _edited(ckpt, tmp_path, **changes)
    with pytest.raises(CheckpointError, match=named.replace(".", r"\.")):
        load_drafter(bad, load_target(ckpt.target_dir))


@pytest.mark.parametrize(
    "key",
    [
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
        "layers.0.mlp_conv.base_kernel",
    ],
)
def test_a_missing_weight_is_refused_naming_it(
    ckpt: TinyCheckpoint, tmp_path: Path, key: str
) -> None:
    bad = _edited(ckpt, tmp_path)
    weights = load_file(str(bad / "model.safetensors"))
    del weights[key]
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        load_drafter(bad, load_target(ckpt.target_dir))


# ---- the engine with a DFlash2 drafter ---------------------------------------------------


def make_engine(ckpt: TinyCheckpoint, k: int | None = None, **kw: object) -> Engine:
    config = EngineConfig(
        target_path=ckpt.target_dir,
        drafter_path=None if k is None else ckpt.drafter_dir,
        num_speculative_tokens=k,
        max_num_seqs=4,
        max_model_len=128,
    )
    return Engine(replace(config, **kw))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def requests(ckpt: TinyCheckpoint) -> list[tuple[list[int], SamplingParams]]:
    return random_requests(0, 10, make_engine(ckpt).vocab_size)


@pytest.fixture(scope="module")
def reference(
    ckpt: TinyCheckpoint, requests: list[tuple[list[int], SamplingParams]]
) -> dict[str, list[int]]:
    out = run(make_engine(ckpt), requests)
    return {rid: o.token_ids_delta for rid, o in out.items()}


@pytest.mark.parametrize(("k", "adaptive"), [(7, False), (2, False), (7, True)])
def test_greedy_with_a_dflash2_drafter_is_plain_greedy(
    ckpt: TinyCheckpoint,
    requests: list[tuple[list[int], SamplingParams]],
    reference: dict[str, list[int]],
    k: int,
    adaptive: bool,
) -> None:
    engine = make_engine(ckpt, k=k, adaptive=adaptive)
    assert isinstance(engine.runner._state.drafter, DFlash2Drafter)
    out = run(engine, requests, join_at=[0, 0, 1, 2, 2, 3, 5, 5, 8, 9])
    assert {rid: o.token_ids_delta for rid, o in out.items()} == reference
    stats = engine.stats()
    assert stats.num_accepted_tokens > 0
    if not adaptive:
        assert stats.num_draft_tokens == stats.num_drafts * k
        spec = out["0"].metrics.spec
        assert spec is not None and spec.num_drafted == len(spec.per_step_drafted) * k


def test_seeded_sampling_is_reproducible_and_logprobs_are_the_targets(
    ckpt: TinyCheckpoint,
) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True, logprobs=2)

    def sample(k: int | None, seed: int = 7) -> tuple[list[int], list[float]]:
        out = run(make_engine(ckpt, k=k), [([7, 8, 9], replace(params, seed=seed))])["0"]
        assert out.logprobs_delta is not None
        return out.token_ids_delta, [e.logprob for e in out.logprobs_delta]

    tokens, logprobs = sample(5)
    assert sample(5) == (tokens, logprobs)
    assert any(sample(5, seed)[0] != tokens for seed in (8, 9, 10))
    # seeded draws are keyed by position: the plain engine commits the same text
    plain_tokens, plain_logprobs = sample(None)
    assert plain_tokens == tokens
    assert logprobs == pytest.approx(plain_logprobs, abs=1e-5)


def test_greedy_lists_each_tokens_logprob_under_dflash2(ckpt: TinyCheckpoint) -> None:
    params = replace(GREEDY, logprobs=3)
    out = run(make_engine(ckpt, k=7), [([1, 2, 3], params)])["0"]
    plain = run(make_engine(ckpt), [([1, 2, 3], params)])["0"]
    assert out.token_ids_delta == plain.token_ids_delta
    assert out.logprobs_delta is not None and plain.logprobs_delta is not None
    assert [e.token_id for e in out.logprobs_delta] == out.token_ids_delta
    assert [e.logprob for e in out.logprobs_delta] == pytest.approx(
        [e.logprob for e in plain.logprobs_delta], abs=1e-5
    )


BUNDLED = Path(__file__).resolve().parents[2] / "engine/assets/tiny-coder"


@pytest.mark.skipif(
    not (BUNDLED / "dflash/model.safetensors").exists(), reason="bundled pair not present"
)
def test_an_identity_dflash2_drafter_drafts_what_its_dflash_drafter_drafts(
    tmp_path: Path,
) -> None:
    """The bundled trained DFlash drafter's weights in a DFlash2 drafter whose convolutions
    are the identity and whose codebooks are zero: every step drafts and accepts exactly
    what the DFlash drafter does (the DFlash2 path adds nothing else)."""
    target = load_target(BUNDLED / "target")
    dflash = load_drafter(BUNDLED / "dflash", target)
    extra = DFlash2Config(conv_kernel_size=4, conv_group_size=64, selector_rank=8, selector_top_k=8)
    dflash2 = DFlash2Drafter(dflash.config, extra, target.model.embed_tokens, target.lm_head)
    dflash2.load_state_dict(dflash.state_dict(), strict=False)  # convs: identity at init
    save_drafter(dflash2, tmp_path / "dflash2")
    prompts = [[5, 17, 300, 42, 9], [100, 101, 102]]
    params = replace(GREEDY, max_tokens=24)

    def steps(drafter_dir: Path) -> dict[str, list[int]]:
        engine = Engine(
            EngineConfig(
                target_path=BUNDLED / "target",
                drafter_path=drafter_dir,
                num_speculative_tokens=15,
                max_num_seqs=2,
                max_model_len=128,
            )
        )
        out = run(engine, [(p, params) for p in prompts])
        per_step = {}
        for rid, o in out.items():
            assert o.metrics.spec is not None
            per_step[rid] = o.metrics.spec.per_step_accepted
        return per_step

    first = steps(BUNDLED / "dflash")
    assert steps(tmp_path / "dflash2") == first
    assert sum(map(sum, first.values())) > 0
