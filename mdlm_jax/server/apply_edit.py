"""Apply-edit: merge an update snippet into the original file.

The request holds the original between `<|original_code|>` tags and a
snippet between `<|update_snippet|>` tags; the snippet writes only what
changes, with lines like `# ... existing code ...` standing for code it
leaves as it is. The merge is alignment first, the model second:

- Alignment (this module, deterministic): the snippet splits at its elision
  lines into segments. Each segment's lines that equal a line of the
  original (in order, after the previous segment) are its anchors: the
  original between its first and last anchor becomes the segment. Lines
  before the first anchor or after the last replace the original lines
  they continue when alike (difflib ratio >= 0.6 line by line), else are
  inserted. Original lines no segment covers are kept byte for byte.
- The model: a segment with no line like any original line cannot be
  placed by alignment. The original lines where it may go (between the
  previous segment and the next one) stay, in order, and the segment is
  put between two of them: the model chooses which, decoding the region
  under a grammar whose alternatives are exactly those placements, with the
  merged text before it as prompt and after it as suffix (`decide`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Callable

ORIGINAL = ("<|original_code|>", "<|/original_code|>")
SNIPPET = ("<|update_snippet|>", "<|/update_snippet|>")
# A comment line standing for elided code: "# ... existing code ...",
# "// ... rest of the file ...", "/* ... */", "<!-- ... -->".
ELISION = re.compile(r"^\s*(#|//|/\*|<!--|--|;)\s*(\.\.\.|…).*$")
ALIKE = 0.6


class EditError(ValueError):
  """The request is not an original plus an update snippet."""


def parse(content: str) -> tuple[str, str]:
  """(original, snippet) from the user message's tags; the newline right
  after an opening tag and right before a closing one belong to the tags."""
  def between(tags):
    start, end = content.find(tags[0]), content.find(tags[1])
    if start < 0 or end < start:
      raise EditError(f"needs {tags[0]}...{tags[1]}")
    text = content[start + len(tags[0]):end]
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text
  return between(ORIGINAL), between(SNIPPET)


@dataclasses.dataclass
class Undecided:
  """A segment alignment could not place: it goes before one of `lines`
  (the original lines that may surround it) or after them all."""
  segment: list[str]
  lines: list[str]

  def candidates(self) -> list[list[str]]:
    return [self.lines[:k] + self.segment + self.lines[k:] for k in range(len(self.lines) + 1)]


def _segments(snippet: str) -> list[list[str]]:
  out, cur = [], []
  for line in snippet.removesuffix("\n").split("\n"):
    if ELISION.match(line):
      if cur:
        out.append(cur)
      cur = []
    else:
      cur.append(line)
  if cur:
    out.append(cur)
  return [s for s in out if any(line.strip() for line in s)]


def _anchors(segment: list[str], original: list[str], start: int) -> list[tuple[int, int]]:
  """(segment line, original line) pairs of exact matches, in order, original from `start`."""
  key = lambda line: line.rstrip()  # noqa: E731
  sm = difflib.SequenceMatcher(None, [key(x) for x in segment], [key(x) for x in original[start:]], autojunk=False)
  pairs = [(a + k, start + b + k) for a, b, n in sm.get_matching_blocks() for k in range(n)]
  return [(a, o) for a, o in pairs if segment[a].strip()]  # blank lines anchor nothing


def _alike(a: str, b: str) -> bool:
  return a.strip() != "" and difflib.SequenceMatcher(None, a.strip(), b.strip()).ratio() >= ALIKE


def plan(original: str, snippet: str) -> list[list[str] | Undecided]:
  """The merged file as pieces in order: decided lines, or an `Undecided`
  segment for the model to place."""
  orig = original.split("\n")
  pieces: list[list[str] | Undecided] = []
  cursor = 0  # original lines before it are placed
  pending: list[list[str]] = []  # unanchored segments waiting for the next anchored one
  for segment in _segments(snippet):
    pairs = _anchors(segment, orig, cursor)
    if not pairs:  # fuzzy: a changed line still names where it goes
      fuzzy = [(a, o) for a, line in enumerate(segment) for o in range(cursor, len(orig)) if _alike(line, orig[o])]
      pairs = fuzzy[:1]
    if not pairs:
      pending.append(segment)
      continue
    (a0, o0), (a1, o1) = pairs[0], pairs[-1]
    head, tail = segment[:a0], segment[a1 + 1:]
    # Head lines replace the original lines just before the anchor when alike.
    back = 0
    while back < len(head) and o0 - back - 1 >= cursor and _alike(head[-1 - back], orig[o0 - back - 1]):
      back += 1
    gap = orig[cursor:o0 - back]
    _flush(pieces, pending, gap)
    pieces.append(segment[:a1 + 1])
    # Tail lines replace the original lines right after the last anchor when alike.
    ahead = 0
    while ahead < len(tail) and o1 + ahead + 1 < len(orig) and _alike(tail[ahead], orig[o1 + ahead + 1]):
      ahead += 1
    pieces.append(tail)
    cursor = o1 + 1 + ahead
  _flush(pieces, pending, orig[cursor:])
  return [p for p in pieces if not (isinstance(p, list) and not p)]


def _flush(pieces, pending: list[list[str]], gap: list[str]) -> None:
  """The original lines of `gap`, with the pending unanchored segments to be
  placed among them (one `Undecided` each; they share the gap in order)."""
  if not pending:
    pieces.append(list(gap))
    return
  for i, segment in enumerate(pending):
    pieces.append(Undecided(segment, list(gap) if i == 0 else []))
  pending.clear()


def merge(original: str, snippet: str, decide: Callable[[str, list[str], str], int]) -> str:
  """The merged file. `decide(before, candidates, after)` returns the index
  of the candidate text for an undecided region, given the merged text
  around it (called in order, only where alignment cannot decide)."""
  pieces = plan(original, snippet)
  lines: list[str] = []
  for i, p in enumerate(pieces):
    if isinstance(p, Undecided):
      options = p.candidates()
      if len(options) == 1:
        lines += options[0]
        continue
      after = [x for q in pieces[i + 1:] for x in (q if isinstance(q, list) else q.lines)]
      texts = ["\n".join(o) for o in options]
      k = decide("\n".join(lines) + ("\n" if lines else ""), texts, ("\n" if after else "") + "\n".join(after))
      lines += options[k]
    else:
      lines += p
  return "\n".join(lines)


__all__ = ["ELISION", "EditError", "Undecided", "merge", "parse", "plan"]
