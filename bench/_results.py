"""bench/RESULTS.md: one ``## <name>`` section per benchmark, rewritten in place by its script."""
from __future__ import annotations

from pathlib import Path

RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"


def replace_section(name: str, section: str, path: Path = RESULTS_MD) -> None:
    """Put ``section`` (starting with ``## name``) in place of the file's ``## name`` section, or
    append it; the other sections are left as they are."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    start = text.find(f"## {name}\n")
    if start >= 0:
        nxt = text.find("\n## ", start + 1)
        text = text[:start] + section.rstrip("\n") + "\n" + (text[nxt:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    path.write_text(text)
