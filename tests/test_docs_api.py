"""``docs/api.md`` documents every public name of ``meshplan`` and its examples run as written.

Each ```python block is run in a fresh namespace and environment, in a temporary working
directory, in this process (torch is imported once for all of them). A name in ``meshplan.__all__`` without its own
``### `name` `` section holding at least one example fails, and so does a section for a name
that is not public (a stale entry). README links the page.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

import meshplan

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "api.md"
SECTION = re.compile(r"^### `([A-Za-z_]+)`\s*$", re.M)
BLOCK = re.compile(r"^```python\n(.*?)^```\s*$", re.M | re.S)


def sections(text: str) -> dict[str, str]:
    """``### `name` `` heading -> the text up to the next heading of level 2 or 3."""
    out: dict[str, str] = {}
    heads = list(SECTION.finditer(text))
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        body = text[m.end():end]
        nxt = re.search(r"^## ", body, re.M)
        out[m.group(1)] = body[: nxt.start()] if nxt else body
    return out


def examples(text: str) -> list[tuple[str, str]]:
    """(id, code) of every ```python block, the id naming its section and position."""
    out = []
    where = [(m.start(), m.group(1)) for m in SECTION.finditer(text)]
    for n, m in enumerate(BLOCK.finditer(text)):
        name = next((w for pos, w in reversed(where) if pos < m.start()), "intro")
        out.append((f"{n:02d}-{name}", m.group(1)))
    return out


TEXT = DOC.read_text()
EXAMPLES = examples(TEXT)


def test_every_public_name_has_a_section_with_an_example() -> None:
    found = sections(TEXT)
    missing = sorted(set(meshplan.__all__) - set(found))
    assert not missing, f"docs/api.md has no '### `name`' section for {missing}"
    stale = sorted(set(found) - set(meshplan.__all__))
    assert not stale, f"docs/api.md documents names that meshplan.__all__ does not export: {stale}"
    bare = sorted(name for name, body in found.items() if not BLOCK.search(body))
    assert not bare, f"docs/api.md sections without a ```python example: {bare}"


def test_the_checks_can_fail() -> None:
    text = "### `a`\nprose\n```python\nx = 1\n```\n## Other\n### `b`\nno example\n"
    assert {k: bool(BLOCK.search(v)) for k, v in sections(text).items()} == {"a": True, "b": False}
    assert [i for i, _ in examples(text)] == ["00-a"]


def test_readme_links_the_api_reference() -> None:
    assert "docs/api.md" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize(("name", "code"), EXAMPLES, ids=[i for i, _ in EXAMPLES])
def test_example_runs(name: str, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    environ = dict(os.environ)  # an example may set torchrun's variables: the next one starts without them
    try:
        exec(compile(code, f"docs/api.md[{name}]", "exec"), {"__name__": f"docs_api_{name.replace('-', '_')}"})
    finally:
        os.environ.clear()
        os.environ.update(environ)
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():  # an example that failed midway
            dist.destroy_process_group()
    assert capsys.readouterr().out.strip() or "print(" not in code, "an example that prints printed nothing"
