"""docs/architecture.md names every file of the core, at its path (a file added or moved
without its paragraph fails here)."""
from __future__ import annotations

from pathlib import Path

import zero_strategy

CORE = Path(zero_strategy.__file__).resolve().parent
DOC = CORE.parent / "docs" / "architecture.md"


def test_every_core_file_has_its_paragraph():
    text = DOC.read_text()
    files = sorted(str(p.relative_to(CORE)) for p in CORE.rglob("*.py")
                   if p.name != "__init__.py" and "__pycache__" not in p.parts and p.parent.name != "integrations"
                   and "integrations" not in p.relative_to(CORE).parts)
    missing = [f for f in files if f"**`{f}`**" not in text]
    assert not missing, f"docs/architecture.md has no paragraph for: {missing}"
    named = [line.split("**`")[1].split("`**")[0] for line in text.splitlines() if line.startswith("- **`")]
    stale = [n for n in named if n.endswith(".py") and not (CORE / n).exists()]
    assert not stale, f"docs/architecture.md describes files that do not exist: {stale}"
