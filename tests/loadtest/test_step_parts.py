"""`dflash-bench step --parts` (loadtest/step_parts.py): DFlash2's convolution and selector
timed inside the draft phase, and the engine's functions left as they were."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import dflash2
from loadtest import bench
from loadtest.harness import BUNDLED
from loadtest.step_parts import timing_parts


def test_parts_are_timed_inside_the_draft_phase(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "step.json"
    argv = ["step", "--drafter", str(BUNDLED / "dflash2"), "--batch-sizes", "1"]
    argv += ["--block-sizes", "8", "--steps", "3", "--rounds", "1", "--parts", "--json", str(out)]
    assert bench.main(argv) == 0
    assert "selector" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["parts"] is True
    by_width = {(c["width"], c["drafter"]): c for c in report["runs"]["quiet"]["columns"]}
    drafting = by_width[(8, True)]
    parts, phases = drafting["parts_plain_steps"], drafting["phases_plain_steps"]
    assert parts["conv"] > 0 and parts["selector"] > 0
    assert parts["conv"] + parts["selector"] < phases["draft"]  # both run inside the draft
    assert by_width[(1, True)]["parts_plain_steps"] == {"conv": 0.0, "selector": 0.0}
    assert by_width[(1, False)]["parts_plain_steps"] == {"conv": 0.0, "selector": 0.0}


def test_the_wrapped_functions_are_restored_even_after_an_error() -> None:
    originals = (dflash2.top_candidates, dflash2.greedy_walk, dflash2.GroupedConv.prepare)
    seconds: dict[str, float] = {}
    with pytest.raises(RuntimeError), timing_parts(seconds):
        assert dflash2.greedy_walk is not originals[1]
        raise RuntimeError("boom")
    assert (dflash2.top_candidates, dflash2.greedy_walk, dflash2.GroupedConv.prepare) == originals
    assert seconds == {"conv": 0.0, "selector": 0.0}
