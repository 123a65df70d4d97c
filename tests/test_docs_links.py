"""Relative links in the Markdown documentation (README, BENCHMARKS, docs/) point at files that
exist and, with a #fragment, at a heading of that file (GitHub's anchors)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(path):
  """GitHub's heading anchors of `path`: lower case, punctuation dropped, spaces to hyphens,
  a repeated heading numbered -1, -2, ..."""
  anchors, in_code = set(), False
  for line in path.read_text(encoding="utf-8").splitlines():
    if line.startswith("```"):
      in_code = not in_code
    heading = re.match(r"#{1,6} (.*)", line)
    if heading and not in_code:
      slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
      anchor, n = slug, 0
      while anchor in anchors:
        n += 1
        anchor = f"{slug}-{n}"
      anchors.add(anchor)
  return anchors


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document):
  broken = []
  for target in LINK.findall(document.read_text(encoding="utf-8")):
    if re.match(r"[a-z]+:", target):
      continue  # http(s), mailto: not checked offline
    path, _, fragment = target.partition("#")
    linked = (document.parent / path).resolve() if path else document
    if not linked.exists():
      broken.append(f"{target}: no such file")
    elif fragment and linked.suffix == ".md" and fragment not in _anchors(linked):
      broken.append(f"{target}: no heading with that anchor")
  assert not broken, f"{document.relative_to(ROOT)}: " + "; ".join(broken)
