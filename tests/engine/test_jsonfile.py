"""The torch-free JSON reader shared by settings validation and the checkpoint loader."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.jsonfile import read_json_object


def test_reads_an_object(tmp_path: Path) -> None:
    file = tmp_path / "config.json"
    file.write_text('{"block_size": 16}')
    assert read_json_object(file) == {"block_size": 16}


@pytest.mark.parametrize(
    ("text", "message"), [("{broken", "cannot read"), ("[1, 2]", "is not a JSON object")]
)
def test_bad_files_say_why_in_one_line(tmp_path: Path, text: str, message: str) -> None:
    file = tmp_path / "config.json"
    file.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        read_json_object(file)
    assert "\n" not in str(info.value)


def test_a_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        read_json_object(tmp_path / "absent.json")
