"""Run a section's Python example of a guide in docs/ as a user would: a script in a fresh folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_section_example(
    tmp_path: Path, guide: str, heading: str
) -> subprocess.CompletedProcess[str]:
    """Run the one ```python block under ``## heading`` of ``docs/guide`` with warnings as errors.

    The script runs in ``tmp_path`` with the checkout's ``src`` on the path.
    """
    text = (REPO / "docs" / guide).read_text()
    section = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    script = tmp_path / "example.py"
    script.write_text(example)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-W", "error", "-W", "ignore::DeprecationWarning", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
