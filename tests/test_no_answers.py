"""No exercise's answer is within the student's reach.

An exercise makes the student write the idea only if its answer is not already printed by a
lecture, shipped in ``course_utils`` (the grader's side included: students have its source), or
given as code in an exercise notebook. For every solution block of ``solutions/`` this test
normalises the block's lines (comments, spacing and quotes dropped) and looks for them in every
lecture notebook, every exercise notebook and every source file of the package. A block is
"in reach" of a source when most of its substantial lines appear there, or when three of them
appear there in a row. Short, generic lines (``return out``, ``j += 1``) are ignored.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
MIN_CHARS = 14  # a normalised line shorter than this is too generic to tell anything
BEGIN = re.compile(r"^\s*(###|//) BEGIN SOLUTION\s*$")
END = re.compile(r"^\s*(###|//) END SOLUTION\s*$")


def normalise(line: str) -> str:
    """The line without comments, spaces or quote style: what copying would keep."""
    line = re.sub(r"(?<![:\"'])#.*$", "", line)  # Python comment
    # A C++ comment: the whole line, or after a statement (Python's // divides, so keep it).
    line = re.sub(r"^\s*//.*$", "", line)
    line = re.sub(r"([;{}])\s*//.*$", r"\1", line)
    line = line.replace('"', "'")
    return re.sub(r"\s+", "", line)


# The vocabulary every kernel shares: a thread's global index and its bounds guard. A line of
# this set says nothing about whether a student wrote the exercise's idea.
IDIOMS = {
    "i=cuda.blockIdx.x*cuda.blockDim.x+cuda.threadIdx.x",
    "inti=blockIdx.x*blockDim.x+threadIdx.x;",
    "i=cuda.grid(1)",
    "row,col=cuda.grid(2)",
    "floatacc=0.0f;",
}


def substantial(lines):
    out = []
    for line in lines:
        n = normalise(line)
        if n in IDIOMS:
            continue
        if len(n) >= MIN_CHARS and not n.startswith(("raiseNotImplementedError", "defcheck")):
            out.append(n)
    return out


def code_cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def solution_blocks(path: Path):
    """(cell index, block's lines) for each solution block of a solution notebook."""
    for index, source in enumerate(code_cells(path)):
        block = None
        for line in source.split("\n"):
            if BEGIN.match(line):
                block = []
            elif END.match(line):
                yield index, block
                block = None
            elif block is not None:
                block.append(line)


def sources():
    """Every text a student can read besides the solutions: name -> normalised lines."""
    found = {}
    for folder in ("notebooks", "exercises"):
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            lines = [ln for cell in code_cells(path) for ln in cell.split("\n")]
            found[f"{folder}/{path.name}"] = [normalise(ln) for ln in lines]
    for path in sorted((ROOT / "course_utils").rglob("*")):
        if path.suffix in (".py", ".cu", ".cuh", ".h", ".cpp") and path.is_file():
            lines = path.read_text(errors="replace").split("\n")
            found[str(path.relative_to(ROOT))] = [normalise(ln) for ln in lines]
    return found


SOURCES = sources()


def in_reach(block: list[str], text: list[str]) -> str:
    """Why ``block`` (substantial normalised lines) can be copied from ``text``, or ""."""
    present = set(text)
    hits = [ln in present for ln in block]
    if block and sum(hits) * 2 > len(block) and sum(hits) >= min(2, len(block)):
        return f"{sum(hits)} of its {len(block)} substantial lines are there"
    run = 0
    for hit in hits:
        run = run + 1 if hit else 0
        if run >= 3:
            return "three of its lines in a row are there"
    return ""


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_solution_blocks_are_not_in_reach(path):
    problems = []
    for index, block in solution_blocks(path):
        lines = substantial(block)
        for name, text in SOURCES.items():
            why = in_reach(lines, text)
            if why:
                first = lines[0] if lines else ""
                problems.append(f"code cell {index} (starting `{first[:60]}`): {why} in {name}")
    assert not problems, "answers within the student's reach:\n" + "\n".join(problems)


def test_the_search_can_find_a_copy():
    block = substantial(["m_new = torch.maximum(m, S.amax(dim=-1))",
                         "alpha = torch.exp(m - m_new)", "l = alpha * l + P.sum(dim=-1)"])
    text = [normalise(x) for x in ["x = 1", "m_new = torch.maximum(m,S.amax(dim=-1))  # max",
                                   'alpha = torch.exp(m - m_new)', "l = alpha*l + P.sum(dim=-1)"]]
    assert in_reach(block, text)
    assert not in_reach(block, [normalise("alpha = torch.exp(m - m_new)")])


def markdown_code(path: Path) -> list[str]:
    """The code an exercise notebook's text shows: fenced blocks and `inline` spans of its
    markdown cells, a line each, normalised."""
    nb = json.loads(path.read_text())
    found = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"])
        for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
            found += block.split("\n")
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        found += re.findall(r"`([^`\n]+)`", text)
        # a statement written as math: $m_{new} = \max(m, ...)$ reads the same once the
        # LaTeX is gone; keep the raw text too
        found += text.split("\n")
    return [normalise(x) for x in found]


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_exercise_text_does_not_state_the_answer(path):
    """The task asks for the step: its text does not list the statements of its answer. One
    substantial line of the answer quoted in the text is allowed (a name, a signature); two are
    a transcription."""
    shown = set(markdown_code(ROOT / "exercises" / path.name))
    problems = []
    for index, block in solution_blocks(path):
        lines = substantial(block)
        quoted = [ln for ln in lines if ln in shown]
        if len(quoted) >= 2 or (quoted and len(lines) <= 2):
            problems.append(f"code cell {index}: its text shows {len(quoted)} of the answer's "
                            f"{len(lines)} substantial lines, e.g. `{quoted[0][:70]}`")
    assert not problems, "exercise texts that state their answer:\n" + "\n".join(problems)
