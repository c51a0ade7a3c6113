"""`dflash-train adapt` end to end on a small prose-traffic dataset made by the bundled target
itself (the recipe trained on Python only): held-out traffic tau rises, the written drafter
loads and is lossless, a rerun resumes, and each bad input fails cleanly, writing nothing."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.loader import load_drafter, load_target
from engine.tokenizer import Tokenizer
from engine.train import adapt
from engine.train.adapt import AdaptConfig, AdaptError, AdaptResult, run_adapt
from engine.train.cli import main
from engine.train.distill import generate_with_features
from tests.engine.train.test_bundled import _decode
from wire.capture import CapturedCompletion, CapturedSample, encode_shard

ASSETS = Path(__file__).resolve().parents[3] / "engine" / "assets" / "tiny-coder"
TOPICS = ["the sea", "a red fox", "winter", "coffee", "mountains", "trains", "the moon", "rain"]
TOPICS += ["bread", "snow", "bees", "a river", "the desert", "a garden"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _sample(
    sample_id: str, completion: CapturedCompletion, temperature: float, **kw: object
) -> CapturedSample:
    fields: dict[str, object] = {
        "id": sample_id,
        "time": 1.0,
        "endpoint": "chat",
        "model": "tiny-coder",
        "pool": "dflash",
        "completions": [completion],
        "sampling": {"temperature": temperature},
    }
    fields.update(kw)
    return CapturedSample(**fields)  # type: ignore[arg-type]


def write_shard(folder: Path, samples: list[CapturedSample], name: str = "a") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"capture-20260101T000000Z-{name}.jsonl.zst"
    path.write_bytes(encode_shard([s.line() for s in samples]))
    return path


def prose_traffic() -> list[CapturedSample]:
    """The target's own greedy answers to prose requests (chat and completions): served at
    T = 0 with token ids, and a few as text only at T = 0.7 (train_on="greedy" regenerates
    them); plus one request longer than the target's context."""
    tok = Tokenizer.from_dir(ASSETS / "target")
    target = load_target(ASSETS / "target")
    out = []
    for i, topic in enumerate(TOPICS):
        for kind in ("chat", "completions"):
            messages = [{"role": "user", "content": f"Write a short poem about {topic}."}]
            text = f"Dear diary, today I saw {topic} and"
            if kind == "chat":
                prompt, kw = tok.apply_chat_template(messages), {"messages": messages}
            else:
                prompt, kw = tok.encode(text), {"prompt": text, "endpoint": "completions"}
            seq, _ = generate_with_features(target, torch.tensor([prompt]), 32, [5])
            ids = seq[0, len(prompt) :].tolist()
            sampled = i % 5 == 4
            completion = CapturedCompletion(tok.decode(ids), None if sampled else ids, "length")
            out.append(_sample(f"req-{kind}-{i}", completion, 0.7 if sampled else 0.0, **kw))
    long = [{"role": "user", "content": "the sea " * 1500}]
    out.append(_sample("req-too-long", CapturedCompletion("the sea"), 0.0, messages=long))
    return out


@pytest.fixture(scope="module")
def traffic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    samples = prose_traffic()
    data = tmp_path_factory.mktemp("data")
    write_shard(data, samples[:20], "a")
    write_shard(data, samples[20:], "b")
    return data


def config(data: Path, root: Path, **kw: object) -> AdaptConfig:
    base = AdaptConfig(
        data=str(data),
        out=root / "adapted",
        target=ASSETS / "target",
        drafter=ASSETS / "dflash",
        runs_dir=root / "runs",
        steps=30,
        batch_seqs=4,
        anchors_per_seq=8,
        lr=1e-3,
        eval_prompts=3,
        eval_tokens=24,
        recipe_samples=8,  # no distillation chunks given: adapt makes these (adapt_recipe.py)
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def adapted(
    traffic: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[AdaptConfig, AdaptResult, str]:
    cfg = config(traffic, tmp_path_factory.mktemp("adapt"))
    err = io.StringIO()  # its progress (stdout) and its warnings (stderr)
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        result = run_adapt(cfg)
    return cfg, result, err.getvalue()


def test_heldout_traffic_tau_rises_and_the_drafter_is_written_with_its_manifest(
    adapted: tuple[AdaptConfig, AdaptResult, str],
) -> None:
    cfg, result, err = adapted
    assert "req-too-long" in err and "longer than the target's context" in err
    assert result.written and result.after.traffic > result.before.traffic
    assert result.steps == 30
    manifest = json.loads((cfg.out / "manifest.json").read_text())
    assert manifest["source_drafter"] == str((ASSETS / "dflash").resolve())
    assert manifest["data"] == cfg.data and manifest["seed"] == 0 and manifest["steps"] == 30
    assert manifest["requests"]["train"] + manifest["requests"]["heldout"] == 2 * len(TOPICS)
    assert manifest["requests"]["heldout"] >= 1 and manifest["samples"]["skipped"] == 1
    held = manifest["requests"]["heldout"]
    assert f"warning: only {held} requests held out" in err  # a few dozen requests captured
    tau = manifest["tau"]
    assert tau["traffic"]["after"] > tau["traffic"]["before"]
    assert tau["recipe"]["before"] >= 1.0 and tau["recipe"]["after"] >= 1.0
    assert manifest["sequences"]["recipe"] == 8 and manifest["recipe_mix"] == 0.5
    assert Path(manifest["recipe_data"]).parent == cfg.runs_dir
    assert sorted(p.name for p in cfg.out.iterdir()) == [
        "config.json",
        "manifest.json",
        "model.safetensors",
    ]
    assert [p.name for p in cfg.out.parent.iterdir() if p.name.startswith(".")] == []


def test_the_adapted_drafter_loads_and_greedy_output_equals_plain_decoding(
    adapted: tuple[AdaptConfig, AdaptResult, str],
) -> None:
    cfg, _, _ = adapted
    tok = Tokenizer.from_dir(ASSETS / "target")
    target = load_target(ASSETS / "target")
    drafter = load_drafter(cfg.out, target)
    assert drafter.block_size == 16
    accepted: list[int] = []
    for topic in ("the sea", "a lighthouse"):
        prompt = tok.apply_chat_template([{"role": "user", "content": f"A poem about {topic}."}])
        plain, _ = _decode(target, drafter, 1, prompt, 40)
        spec, steps = _decode(target, drafter, 16, prompt, 40)
        assert spec == plain
        accepted.extend(steps)
    assert sum(accepted) > 0


def test_a_rerun_resumes_and_a_full_disk_leaves_out_untouched(
    adapted: tuple[AdaptConfig, AdaptResult, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same inputs: the finished checkpoint is found (no step runs again); the write then hits
    ENOSPC: a clear error, no temporary folder left, the earlier output as it was."""
    cfg, _, _ = adapted
    before = {p.name: p.read_bytes() for p in cfg.out.iterdir()}

    def full_disk(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(adapt, "save_compact", full_disk)
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(AdaptError) as exc:
        run_adapt(cfg)
    assert "No space left on device" in str(exc.value) and str(cfg.out) in str(exc.value)
    assert {p.name: p.read_bytes() for p in cfg.out.iterdir()} == before
    assert [p.name for p in cfg.out.parent.iterdir() if p.name.startswith(".")] == []
    (run_dir,) = [p for p in cfg.runs_dir.iterdir() if not p.name.startswith("recipe-")]
    steps = [json.loads(line)["step"] for line in (run_dir / "log.jsonl").open()]
    assert steps == sorted(set(steps)) and steps[-1] == 29  # logged once: nothing re-ran


def test_no_rise_writes_nothing_and_exits_3(
    traffic: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(adapt, "train", lambda *_: (0, 0, 0.0))  # the drafter stays as it was
    out = tmp_path / "out"
    argv = ["adapt", "--data", str(traffic), "--out", str(out), "--runs-dir", str(tmp_path)]
    argv += ["--eval-prompts", "2", "--eval-tokens", "16", "--recipe-data", str(tmp_path / "none")]
    argv += ["--recipe-samples", "0"]  # traffic only: nothing trains here anyway
    assert main(argv) == 3
    assert "did not rise" in capsys.readouterr().out
    assert not out.exists()


# ---- bad input: exit 1, a message naming the culprit, nothing in --out --------------------


def run_cli(data: Path, tmp_path: Path, *extra: str) -> int:
    out = tmp_path / "out"
    argv = ["adapt", "--data", str(data), "--out", str(out), "--runs-dir", str(tmp_path / "runs")]
    code = main([*argv, "--steps", "2", *extra])
    assert not out.exists()
    return code


def test_a_truncated_shard_is_named(
    traffic: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    good = sorted(traffic.iterdir())[0]
    (data / good.name).write_bytes(good.read_bytes()[:200])
    assert run_cli(data, tmp_path) == 1
    err = capsys.readouterr().err
    assert "dflash-train: error:" in err and good.name in err and "not a complete zstd shard" in err


def test_an_empty_dataset_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert run_cli(tmp_path / "empty", tmp_path) == 1
    assert "no capture shards" in capsys.readouterr().err
    assert run_cli(tmp_path / "nothing", tmp_path) == 1
    assert "nothing: does not exist" in capsys.readouterr().err


def test_a_count_that_is_not_positive_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for flag in ("--steps", "--eval-tokens"):
        with pytest.raises(SystemExit) as exited:
            run_cli(tmp_path, tmp_path, flag, "0")
        assert exited.value.code == 2
        assert f"{flag} must be positive, not 0" in capsys.readouterr().err


def test_a_dataset_of_only_too_long_samples_names_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    long = [{"role": "user", "content": "the sea " * 1500}]
    sample = _sample("req-huge", CapturedCompletion("the sea"), 0.0, messages=long)
    write_shard(tmp_path / "data", [sample])
    assert run_cli(tmp_path / "data", tmp_path) == 1
    assert "req-huge" in capsys.readouterr().err


def test_token_ids_outside_the_vocabulary_name_the_sample(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    bad = _sample("req-alien", CapturedCompletion("x", [5, 6, 70000]), 0.0, messages=messages)
    write_shard(tmp_path / "data", [bad])
    assert run_cli(tmp_path / "data", tmp_path) == 1
    err = capsys.readouterr().err
    assert "req-alien" in err and "70000" in err


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("hidden_size", 128, "hidden_size"),
        ("vocab_size", 8192, "vocab_size"),
        ("target_layer_ids", [1, 3, 9], "target_layer_ids"),
        ("mask_token_id", 5000, "mask_token_id"),
    ],
)
def test_a_drafter_for_another_target_names_the_key(
    traffic: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    key: str,
    value: object,
    named: str,
) -> None:
    drafter = tmp_path / "drafter"
    shutil.copytree(ASSETS / "dflash", drafter)
    config = json.loads((drafter / "config.json").read_text())
    (config["dflash_config"] if key in config["dflash_config"] else config)[key] = value
    (drafter / "config.json").write_text(json.dumps(config))
    assert run_cli(traffic, tmp_path, "--drafter", str(drafter)) == 1
    err = capsys.readouterr().err
    assert "dflash-train: error:" in err and named in err


def test_out_holding_something_else_is_refused(
    traffic: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["adapt", "--data", str(traffic), "--out", str(out), "--runs-dir", str(tmp_path)]
    assert main(argv) == 1
    assert "not an adapt output" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_the_recipe_stages_keep_their_command_line() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["adapt", "--help"])
    assert exc.value.code == 0
    assert main(["--smoke", "adapt"]) == 2  # adapt's options need it named first


def test_recipe_chunks_become_examples_and_batch_with_traffic(tmp_path: Path) -> None:
    """The `distill` stage's chunks (prompt 128 + 128 generated) mix with traffic rows of
    other lengths: one padded batch, each row keeping its own prompt length."""
    tokens = torch.randint(5, 4000, (2, 256), dtype=torch.int32)
    tokens[1, 140] = 2  # a stop: the row ends there
    chunk = {"tokens": tokens, "features": torch.randn(2, 256, 12).half(), "layer_ids": [1, 3, 5]}
    torch.save(chunk, tmp_path / "chunk_0000.pt")
    rows = adapt.recipe_examples(tmp_path, [2], [1, 3, 5])
    assert [int(r.tokens.numel()) for r in rows] == [256, 141]
    assert adapt.recipe_examples(tmp_path / "absent", [2], [1, 3, 5]) == []
    traffic_row = adapt.Example(torch.arange(5, 25), 7, torch.ones(20, 12).half())
    toks, lengths, prompt_lens, feats = adapt.collate([traffic_row, *rows])
    assert toks.shape == (3, 256) and feats.shape == (3, 256, 12)
    assert lengths.tolist() == [20, 256, 141] and prompt_lens.tolist() == [7, 128, 128]
    assert bool((toks[0, 20:] == 0).all()) and bool((feats[0, 20:] == 0).all())
