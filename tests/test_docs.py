"""The README and the guides in docs/: their runnable code blocks run, their links resolve.

A code block is runnable when the line before its fence is ``<!-- runnable -->`` (invisible on
GitHub and in the mkdocs site); ``<!-- runnable: slow -->`` runs it as a ``slow`` test (a whole
pipeline: CI runs it after the README's test command). Python blocks run in a fresh namespace, bash blocks in a shell
with this interpreter's ``bin`` first on PATH (so ``compress`` is the one under test); both with a
temporary directory as the working directory.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = "<!-- runnable -->"
SLOW_MARKER = "<!-- runnable: slow -->"
_BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def runnable_blocks(text: str) -> list[tuple[int, str, str, bool]]:
    """(line, language, code, slow) of each fenced block whose preceding line is a marker."""
    out = []
    for m in _BLOCK.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        if before in (MARKER, SLOW_MARKER):
            out.append((text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2), before == SLOW_MARKER))
    return out


BLOCKS = [(page, *block) for page in PAGES for block in runnable_blocks(page.read_text())]


def test_blocks_are_found() -> None:
    assert runnable_blocks(f"x\n{MARKER}\n```python\nprint(1)\n```\n```python\nno\n```\n{SLOW_MARKER}\n```bash\nls\n```\n") == [
        (3, "python", "print(1)\n", False), (10, "bash", "ls\n", True)
    ]
    assert len(BLOCKS) >= 5, BLOCKS  # the README's one-shot API and the guides' examples


def run_block(lang: str, code: str, where: str, cwd: Path) -> None:
    if lang == "python":
        with contextlib.chdir(cwd), contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, where, "exec"), {"__name__": "__docs__"})
    elif lang == "bash":
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{where} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    else:
        raise AssertionError(f"{where}: a runnable block must be python or bash, not {lang!r}")


@pytest.mark.parametrize(("page", "line", "lang", "code"), [
    pytest.param(p, n, lang, code, marks=[pytest.mark.slow] if slow else [], id=f"{p.relative_to(ROOT)}:{n}")
    for p, n, lang, code, slow in BLOCKS
])
def test_runnable_block(page: Path, line: int, lang: str, code: str, tmp_path: Path) -> None:
    run_block(lang, code, f"{page.relative_to(ROOT)}:{line}", tmp_path)


def test_a_failing_block_fails(tmp_path: Path) -> None:
    with pytest.raises(NameError):
        run_block("python", "undefined_name\n", "broken", tmp_path)
    with pytest.raises(AssertionError, match="exited 3"):
        run_block("bash", "true\nexit 3\n", "broken", tmp_path)


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines < 150, f"README.md has {lines} lines; guides belong in docs/"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    text = _BLOCK.sub("", page.read_text())
    broken = []
    for url in _LINK.findall(text):
        path = url.split("#", 1)[0]
        if not path or re.match(r"^[a-z][a-z0-9+.-]*:", path):
            continue
        if not (page.parent / path).exists():
            broken.append(url)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"
