"""A plagiarism aid: pairs of submissions whose answers are near-identical after normalisation.

``python -m course_utils similar submissions/*/02_*.ipynb --out grades`` compares, chapter by
chapter, what each student wrote: the code cells that differ from the exercise as handed out.
Each answer is normalised before it is compared, so that renaming variables, reformatting,
reordering blank lines or rewriting comments changes nothing:

1. Python's tokenizer drops comments, blank lines and indentation tokens, and strings become one
   token (a docstring's wording does not count);
2. every name a student chose (not a keyword, a builtin, or an attribute after a dot such as
   ``torch.exp``) becomes ``v1``, ``v2``, ... in order of first use;
3. the answer becomes the set of its runs of ``K`` consecutive tokens, minus the runs that the
   exercise's own cells contain (the starter code everyone shares).

Two answers' similarity is the Jaccard index of their sets. A pair is flagged when it reaches
the threshold and both answers have enough runs of their own (a two-line answer that anyone
would write the same way is not evidence). The report is a CSV sorted by similarity, for a
person to read: a flag is a reason to look, never a verdict.
"""

from __future__ import annotations

import builtins
import csv
import io
import json
import keyword
import tokenize
from itertools import combinations
from pathlib import Path

from ... import paths

K = 8  # tokens per run
MIN_RUNS = 25  # runs of its own an answer needs before it can be flagged
THRESHOLD = 0.8
_KEEP = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls"}


def normalise(source: str) -> list[str]:
    """The tokens of ``source`` as compared (see the module's docstring); a cell that does not
    tokenize (a syntax error, IPython magic) is compared line by line as text instead."""
    out: list[str] = []
    names: dict[str, str] = {}
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return [" ".join(line.split()) for line in source.splitlines() if line.strip()]
    previous = ""
    for tok in tokens:
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                        tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        if tok.type == tokenize.STRING:
            out.append("S")
        elif tok.type == tokenize.NAME and tok.string not in _KEEP and previous != ".":
            out.append(names.setdefault(tok.string, f"v{len(names) + 1}"))
        else:
            out.append(tok.string)
        previous = tok.string
    return out


def runs(tokens: list[str], k: int = K) -> set[int]:
    return {hash(tuple(tokens[i:i + k])) for i in range(max(0, len(tokens) - k + 1))}


def _code_cells(text: str) -> list[str]:
    nb = json.loads(text)
    return ["".join(c.get("source", "")) for c in nb.get("cells", [])
            if c.get("cell_type") == "code"]


def _template(chapter: str) -> tuple[set[str], set[int]]:
    """The exercise as handed out: its cells' texts, and their runs."""
    found = sorted((paths.REPO / "exercises").glob(f"{chapter}_*.ipynb"))
    if not found:
        return set(), set()
    cells = _code_cells(found[0].read_text(encoding="utf-8"))
    shared: set[int] = set()
    for cell in cells:
        shared |= runs(normalise(cell))
    return {c.strip() for c in cells}, shared


def answer_runs(text: str, template_cells: set[str], template_runs: set[int]) -> set[int]:
    """The runs of what a student wrote: cells that differ from the handed-out ones, each cell
    normalised on its own (names renumbered per cell), minus the template's runs."""
    mine: set[int] = set()
    for cell in _code_cells(text):
        if cell.strip() in template_cells:
            continue
        mine |= runs(normalise(cell))
    return mine - template_runs


def similar_pairs(notebooks, threshold: float = THRESHOLD) -> list[dict]:
    """Flagged pairs of ``notebooks`` (same chapter only), most similar first."""
    by_chapter: dict[str, list[tuple[str, set[int]]]] = {}
    templates: dict[str, tuple[set[str], set[int]]] = {}
    for p in notebooks:
        chapter = Path(p).name[:2]
        if chapter not in templates:
            templates[chapter] = _template(chapter)
        try:
            text = Path(p).read_text(encoding="utf-8")
            mine = answer_runs(text, *templates[chapter])
        except (OSError, UnicodeDecodeError, ValueError):
            continue  # an unreadable notebook is the grader's business, not this report's
        by_chapter.setdefault(chapter, []).append((str(p), mine))
    flagged = []
    for chapter, answers in by_chapter.items():
        for (a, ra), (b, rb) in combinations(answers, 2):
            if len(ra) < MIN_RUNS or len(rb) < MIN_RUNS:
                continue
            shared = len(ra & rb)
            score = shared / len(ra | rb)
            if score >= threshold:
                flagged.append({"chapter": chapter, "a": a, "b": b,
                                "similarity": round(score, 4), "shared_runs": shared,
                                "runs_a": len(ra), "runs_b": len(rb)})
    flagged.sort(key=lambda f: (-f["similarity"], f["a"], f["b"]))
    return flagged


def write_report(notebooks, out, threshold: float = THRESHOLD) -> tuple[Path, list[dict]]:
    """``OUT/similarity.csv``: the flagged pairs (see :func:`similar_pairs`)."""
    from .store import write_atomic

    pairs = similar_pairs(notebooks, threshold)
    text = io.StringIO()
    w = csv.DictWriter(text, ["chapter", "similarity", "a", "b", "shared_runs", "runs_a",
                              "runs_b"])
    w.writeheader()
    w.writerows(pairs)
    path = Path(out) / "similarity.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text.getvalue())
    return path, pairs
