"""The Python examples in docs/data.md run as written (style guide: examples in docs run)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _blocks(name: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / name).read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(_blocks("data.md"))))
def test_data_doc_example_runs(tmp_path: Path, index: int) -> None:
    script = tmp_path / "example.py"
    script.write_text(_blocks("data.md")[index])
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-W", "ignore::DeprecationWarning", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_every_documented_example_file_has_blocks() -> None:
    assert len(_blocks("data.md")) >= 2
