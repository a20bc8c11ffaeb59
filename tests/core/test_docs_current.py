"""Generated documentation is current (issue #34 item 7): docs/core.md's configuration
table is what scripts/config_table.py makes of ZeroConfig's field docstrings, and it
lists every field the dataclass has."""
import dataclasses
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_config_table_in_core_md_is_generated_from_the_field_docstrings():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "config_table.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_config_table_lists_every_field_once():
    from zero_strategy import ZeroConfig

    doc = (REPO / "docs" / "core.md").read_text()
    for f in dataclasses.fields(ZeroConfig):
        assert doc.count(f"| `{f.name}` |") == 1, f.name
