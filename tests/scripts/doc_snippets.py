"""The code blocks of the README and docs/*.md: each ```python fence after a
``<!-- snippet: NAME -->`` line (tests/scripts/test_readme_snippets.py runs them;
megatron_snippet_worker.py runs the Megatron-core one on two ranks)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_SNIPPET = re.compile(r"<!-- snippet: ([\w-]+) -->\n```python\n(.*?)```", re.DOTALL)


def snippets() -> dict[str, str]:
    found = [f for page in PAGES for f in _SNIPPET.findall(page.read_text())]
    names = [name for name, _ in found]
    assert len(names) == len(set(names)), f"duplicate snippet names in the docs: {names}"
    return dict(found)
