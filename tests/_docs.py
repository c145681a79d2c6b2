"""The shell commands and links written in README.md and docs/*.md, read back for tests/test_docs.py.

A command is what a reader would paste into a shell:
- each command of a ```bash / ```sh / ```shell block (lines joined at a trailing backslash, ``#`` comments
  dropped, ``a && b`` split into its parts);
- each ``$ `` line of a ```console block;
- each inline code span that starts with ``lightning-dcp ``, ``python benchmarks/``, ``python examples/`` or
  ``pip install`` (spans may wrap across lines in the markdown).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class DocCommand:
    text: str          # the command as written (one line, whitespace collapsed)
    source: str        # "docs/cli.md:12"
    inline: bool = False   # an inline code span in prose (else a line of a fenced block)

    @property
    def argv(self) -> list[str]:
        """The words, with an optional flag's brackets dropped (``[--memory-limit-mib 20]``)."""
        words = shlex.split(self.text)
        return [w[1:] if w.startswith("[-") else w[:-1] if w.endswith("]") and "[" not in w else w for w in words]


_FENCE = re.compile(r"^```(\w*)\s*$")
_INLINE_STARTS = ("lightning-dcp ", "python benchmarks/", "python examples/", "pip install ", "time python ",
                  "taskset -c 0 python ")


def _split_fences(text: str):
    """Yield (lang or None, first line number, lines) for fenced blocks and the prose between them."""
    lang, start, buf = None, 1, []
    in_fence = False
    for n, line in enumerate(text.split("\n"), 1):
        m = _FENCE.match(line.strip())
        if m and not in_fence:
            yield None, start, buf
            lang, start, buf, in_fence = m.group(1) or "", n + 1, [], True
        elif line.strip() == "```" and in_fence:
            yield lang, start, buf
            lang, start, buf, in_fence = None, n + 1, [], False
        else:
            buf.append(line)
    yield (lang if in_fence else None), start, buf


def _shell_lines(lines: list[str], first: int, console: bool):
    joined, at = "", None
    for n, line in enumerate(lines, first):
        line = line.strip()
        if console:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        if at is None:
            at = n
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        joined += line
        cmd = " ".join(shlex.split(joined, comments=True, posix=False))
        if cmd:
            for part in cmd.split(" && "):
                yield at, part.strip()
        joined, at = "", None


def commands(path: Path) -> list[DocCommand]:
    rel = path.relative_to(ROOT).as_posix()
    found: list[DocCommand] = []
    for lang, first, lines in _split_fences(path.read_text()):
        if lang in ("bash", "sh", "shell", "console"):
            found += [DocCommand(cmd, f"{rel}:{n}") for n, cmd in _shell_lines(lines, first, lang == "console")]
        elif lang is None:
            prose = "\n".join(lines)
            for m in re.finditer(r"`([^`]+)`", prose):
                span = " ".join(m.group(1).split())
                if span.startswith(_INLINE_STARTS):
                    line = first + prose[:m.start()].count("\n")
                    found.append(DocCommand(span, f"{rel}:{line}", inline=True))
    return found


def all_commands() -> list[DocCommand]:
    return [cmd for path in doc_files() for cmd in commands(path)]


def links(path: Path) -> list[tuple[str, str]]:
    """(target, source) of every relative markdown link outside fenced blocks."""
    rel = path.relative_to(ROOT).as_posix()
    found = []
    for lang, first, lines in _split_fences(path.read_text()):
        if lang is not None:
            continue
        prose = re.sub(r"`[^`]*`", lambda m: re.sub(r"[^\n]", " ", m.group(0)), "\n".join(lines))  # not in code
        for m in re.finditer(r"\]\(([^)\s]+)\)", prose):
            target = m.group(1)
            if not re.match(r"^[a-z]+:", target):
                found.append((target, f"{rel}:{first + prose[:m.start()].count(chr(10))}"))
    return found


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    out = set()
    for lang, _, lines in _split_fences(path.read_text()):
        if lang is not None:
            continue
        for line in lines:
            m = re.match(r"^#{1,6} (.*)$", line)
            if m:
                slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
                out.add(slug)
    return out
