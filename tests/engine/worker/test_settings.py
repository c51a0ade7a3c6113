"""WorkerSettings: vLLM names, defaults, and one-line errors naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.worker.settings import (
    BUNDLED_DRAFTER,
    BUNDLED_TARGET,
    ConfigError,
    WorkerSettings,
    load_settings,
)
from tests.fixtures.tiny_models import TinyCheckpoint


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: TinyCheckpoint) -> TinyCheckpoint:
    return tiny_checkpoint  # the session's tiny random target + drafter (tests/conftest.py)


def spec(path: Path, **extra: object) -> dict[str, object]:
    return {"method": "dflash", "model": str(path), **extra}


def edited_drafter(ckpt: TinyCheckpoint, tmp_path: Path, **changes: object) -> Path:
    out = tmp_path / "drafter"
    shutil.copytree(ckpt.drafter_dir, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def error_of(**values: object) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(**values)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_target_with_drafter_resolves_k_from_block_size(ckpt: TinyCheckpoint) -> None:
    s = load_settings(model=str(ckpt.target_dir), speculative_config=spec(ckpt.drafter_dir))
    assert s.speculative
    assert s.num_speculative_tokens() == 3  # block_size 4 - 1
    assert s.model_name == str(ckpt.target_dir)  # vLLM's default served name is MODEL
    assert s.resolved_max_model_len() == 2048
    assert s.torch_dtype_name() == "float32"
    assert (s.host, s.port, s.max_num_seqs) == ("127.0.0.1", 8001, 8)


def test_explicit_model_without_spec_is_plain_decoding(ckpt: TinyCheckpoint) -> None:
    s = load_settings(model=str(ckpt.target_dir), served_model_name="coder")
    assert s.speculative_config is None
    assert s.num_speculative_tokens() is None
    assert s.model_name == "coder"


def test_defaults_are_the_bundled_tiny_coder() -> None:
    if (BUNDLED_DRAFTER / "config.json").exists() and (BUNDLED_TARGET / "config.json").exists():
        s = load_settings()
        assert s.model == str(BUNDLED_TARGET)
        assert s.speculative_config is not None
        assert s.speculative_config.model == str(BUNDLED_DRAFTER)
        assert s.model_name == "tiny-coder"
    else:  # bundled weights not trained yet: the error names the missing folder
        message = error_of()
        assert "model: " in message and "tiny-coder" in message


def test_k_larger_than_block_size_minus_one(ckpt: TinyCheckpoint) -> None:
    message = error_of(
        model=str(ckpt.target_dir),
        speculative_config=spec(ckpt.drafter_dir, num_speculative_tokens=4),
    )
    assert "speculative_config.num_speculative_tokens" in message
    assert "block_size - 1 = 3" in message


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size"])
def test_drafter_must_match_the_target(ckpt: TinyCheckpoint, tmp_path: Path, key: str) -> None:
    bad = edited_drafter(ckpt, tmp_path, **{key: 48})
    message = error_of(model=str(ckpt.target_dir), speculative_config=spec(bad))
    assert message.startswith("invalid worker setting speculative_config.model:")
    assert key in message


def test_drafter_must_be_dflash(ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    bad = edited_drafter(ckpt, tmp_path, architectures=["Qwen3ForCausalLM"])
    assert "not a DFlash drafter" in error_of(
        model=str(ckpt.target_dir), speculative_config=spec(bad)
    )


def test_drafter_without_block_size(ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    bad = edited_drafter(ckpt, tmp_path, block_size=None)
    assert "block_size" in error_of(model=str(ckpt.target_dir), speculative_config=spec(bad))


def test_method_other_than_dflash_only_for_vllm(ckpt: TinyCheckpoint) -> None:
    eagle = {"method": "eagle3", "model": str(ckpt.drafter_dir), "num_speculative_tokens": 3}
    message = error_of(model=str(ckpt.target_dir), speculative_config=eagle)
    assert "speculative_config.method" in message
    s = load_settings(backend="vllm", model=str(ckpt.target_dir), speculative_config=eagle)
    assert s.speculative_config is not None and s.speculative_config.method == "eagle3"


def test_missing_checkpoint_folder(tmp_path: Path) -> None:
    message = error_of(model=str(tmp_path / "nope"))
    assert message.startswith("invalid worker setting model:")


def test_vllm_backend_accepts_hub_ids() -> None:
    s = load_settings(
        backend="vllm",
        model="Qwen/Qwen3-8B",
        tensor_parallel_size=2,
        speculative_config={"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16"},
        extra_args=("--enable-prefix-caching",),
    )
    assert s.num_speculative_tokens() is None  # not local: vLLM reads it from the drafter


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_num_seqs", 0),
        ("port", 70000),
        ("per_request_spec_decode_metrics", "verbose"),
        ("gpu_memory_utilization", 1.5),
        ("dtype", "int8"),
        ("max_model_len", 4),
        ("tensor_parallel_size", 2),
        ("extra_args", ("--foo",)),
        ("no_such_field", 1),
    ],
)
def test_bad_values_name_the_field(ckpt: TinyCheckpoint, field: str, value: object) -> None:
    message = error_of(model=str(ckpt.target_dir), **{field: value})
    assert message.startswith(f"invalid worker setting {field}")


def test_max_model_len_beyond_the_model(ckpt: TinyCheckpoint) -> None:
    message = error_of(model=str(ckpt.target_dir), max_model_len=8192)
    assert "max_model_len" in message and "4096" in message


def test_settings_are_frozen(ckpt: TinyCheckpoint) -> None:
    s = WorkerSettings(model=str(ckpt.target_dir))
    with pytest.raises(ValueError, match="frozen"):
        s.port = 1  # type: ignore[misc]


def test_drafter_int8_reaches_the_engine_and_is_the_embedded_engines(
    ckpt: TinyCheckpoint,
) -> None:
    from engine.worker.cli import settings_from_args
    from engine.worker.state import engine_config

    s, _ = settings_from_args(
        [
            str(ckpt.target_dir),
            "--drafter-int8",
            "--speculative-config",
            json.dumps(spec(ckpt.drafter_dir)),
        ]
    )
    assert s.drafter_int8 and engine_config(s).drafter_int8
    assert not engine_config(load_settings(model=str(ckpt.target_dir))).drafter_int8
    message = error_of(backend="vllm", model=str(ckpt.target_dir), drafter_int8=True)
    assert message.startswith("invalid worker setting drafter_int8:")
    for needs in (
        {"model": str(ckpt.target_dir)},
        {"device": "cuda", **s.model_dump(include={"model", "speculative_config"})},
    ):
        message = error_of(**needs, drafter_int8=True)
        assert message.startswith("invalid worker setting drafter_int8: needs a drafter")


def test_http_keep_alive_comes_from_vllms_env_variable(
    ckpt: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.worker.cli import settings_from_args

    assert settings_from_args([str(ckpt.target_dir)])[0].http_keep_alive_s == 5  # vLLM's default
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "61")
    assert settings_from_args([str(ckpt.target_dir)])[0].http_keep_alive_s == 61
    for bad in ("0", "2.5", "soon"):
        monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", bad)
        with pytest.raises(ConfigError, match="VLLM_HTTP_TIMEOUT_KEEP_ALIVE"):
            settings_from_args([str(ckpt.target_dir)])


def test_speculation_is_adaptive_on_the_embedded_backend_unless_fixed(
    ckpt: TinyCheckpoint,
) -> None:
    from engine.worker.state import engine_config

    dflash = {"model": str(ckpt.target_dir), "speculative_config": spec(ckpt.drafter_dir)}
    assert engine_config(load_settings(**dflash)).adaptive
    assert not engine_config(load_settings(**dflash, speculation="fixed")).adaptive
    assert not load_settings(model=str(ckpt.target_dir)).adaptive_speculation  # no drafter
    assert not load_settings(**dflash, backend="vllm").adaptive_speculation  # vLLM's own
    message = error_of(**dflash, backend="vllm", speculation="adaptive")
    assert message.startswith("invalid worker setting speculation:")


@pytest.fixture(scope="module")
def dflash2(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    from tests.fixtures.tiny_dflash2 import build_tiny_dflash2_checkpoint

    return build_tiny_dflash2_checkpoint(tmp_path_factory.mktemp("dflash2"))


@pytest.mark.parametrize("method", ["dflash", "dflash2"])
def test_a_dflash2_drafter_under_either_method(dflash2: TinyCheckpoint, method: str) -> None:
    """vLLM decides by the drafter's architecture under "dflash"; "dflash2" says it."""
    s = load_settings(
        model=str(dflash2.target_dir),
        speculative_config={"method": method, "model": str(dflash2.drafter_dir)},
    )
    assert s.num_speculative_tokens() == 7  # block_size 8 - 1
    from engine.worker.state import engine_config

    assert engine_config(s).drafter_path == dflash2.drafter_dir


def test_method_dflash2_needs_a_dflash2_drafter(ckpt: TinyCheckpoint) -> None:
    message = error_of(
        model=str(ckpt.target_dir),
        speculative_config={"method": "dflash2", "model": str(ckpt.drafter_dir)},
    )
    assert "speculative_config.model" in message and "DFlash2DraftModel" in message


def test_dflash2_is_the_embedded_vllm_and_sglang_backends(dflash2: TinyCheckpoint) -> None:
    from engine.worker.sglang_backend import build_sglang_argv
    from engine.worker.vllm_backend import build_vllm_argv

    for method in ("dflash", "dflash2"):
        config = {"method": method, "model": str(dflash2.drafter_dir)}
        message = error_of(
            backend="trtllm", model=str(dflash2.target_dir), speculative_config=config
        )
        assert "DFlash2" in message or "dflash2" in message
        sglang = build_sglang_argv(
            load_settings(
                backend="sglang", model=str(dflash2.target_dir), speculative_config=config
            )
        )
        assert sglang[sglang.index("--speculative-algorithm") + 1] == "DFLASH"
        assert sglang[sglang.index("--speculative-draft-model-path") + 1] == str(
            dflash2.drafter_dir
        )
        s = load_settings(backend="vllm", model=str(dflash2.target_dir), speculative_config=config)
        argv = build_vllm_argv(s)
        sent = json.loads(argv[argv.index("--speculative-config") + 1])
        assert sent["method"] == "dflash"  # vLLM refuses "dflash2": the architecture decides
