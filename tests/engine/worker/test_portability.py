"""Which engine can serve which drafter, from config.json alone."""

from __future__ import annotations

from engine.worker.portability import layer_ids, unportable

TARGET = {"num_hidden_layers": 6}


def test_sglang_cannot_serve_a_drafter_reading_the_last_layer() -> None:
    reads_last = {"dflash_config": {"target_layer_ids": [1, 3, 5]}}
    why = unportable("sglang", reads_last, TARGET)
    assert why is not None
    assert "dflash_config.target_layer_ids [1, 3, 5]" in why and "last layer (5)" in why
    assert "SGLang" in why and "--backend vllm or trtllm" in why
    for engine in ("vllm", "trtllm", "embedded"):
        assert unportable(engine, reads_last, TARGET) is None


def test_earlier_layers_and_unknowns_pass() -> None:
    assert unportable("sglang", {"dflash_config": {"target_layer_ids": [1, 3, 4]}}, TARGET) is None
    assert unportable("sglang", {"target_layer_ids": [0, 2]}, TARGET) is None  # top level
    assert unportable("sglang", {"dflash_config": {}}, TARGET) is None  # the engine's default
    assert unportable("sglang", {"target_layer_ids": [5]}, None) is None  # a hub id: unread
    assert layer_ids({"target_layer_ids": [1, True]}) is None
    assert layer_ids({"dflash_config": {"target_layer_ids": [2, 4]}}) == [2, 4]
