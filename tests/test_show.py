"""show_source: a folded, highlighted listing in Jupyter; a short numbered excerpt elsewhere."""

import pytest

from course_utils import show
from course_utils.grading.harness.ch07 import KERNEL_PATH
from course_utils.publishing.show import PLAIN_MAX_LINES, show_source, source_view

LOOP, EPILOGUE = "    for (int j = 0; j < n_tiles; ++j)", "// END EPILOGUE"


def test_markers_pick_the_lines_and_the_summary_names_the_file():
    lines = KERNEL_PATH.read_text().splitlines()
    v = source_view(KERNEL_PATH, start=LOOP, end=EPILOGUE, title="the K/V loop")
    assert v.lines[0].startswith(LOOP) and EPILOGUE in v.lines[-1]
    assert lines[v.first - 1] == v.lines[0] and lines[v.last - 1] == v.lines[-1]
    assert v.summary == ("the K/V loop (course_utils/library/kernels/flash_attention_forward.cu, "
                         f"lines {v.first}-{v.last} of {len(lines)})")  # fmt: skip


def test_html_is_folded_highlighted_and_has_no_table_rows():
    v = source_view(KERNEL_PATH, start=LOOP, end=EPILOGUE)
    page = v._repr_html_()
    assert page.startswith("<details>") and page.rstrip().endswith("</details>")
    assert "<summary>" in page and "open" not in page.split(">")[0]  # folded
    assert "style=" in page and "<span" in page  # highlighted, with inline styles
    assert "<tr" not in page  # conftest counts table rows as printed lines
    assert f"{v.first}" in page  # numbered as in the file


def test_plain_text_is_short_and_says_what_is_left():
    v = source_view(KERNEL_PATH)
    text = str(v)
    assert len(text.splitlines()) == 1 + PLAIN_MAX_LINES + 1
    assert text.splitlines()[-1] == (f"... {v.total - PLAIN_MAX_LINES} more lines in "
                                     "course_utils/library/kernels/flash_attention_forward.cu "
                                     f"(lines {PLAIN_MAX_LINES + 1}-{v.total})")  # fmt: skip
    short = str(source_view(KERNEL_PATH, 1, 3))
    assert "more lines" not in short and len(short.splitlines()) == 4


def test_show_source_prints_the_excerpt_without_a_front_end(capsys, monkeypatch):
    monkeypatch.setattr(show, "_html_front_end", lambda: False)
    show_source(KERNEL_PATH, start=LOOP, end=EPILOGUE)
    out = capsys.readouterr().out
    assert len(out.splitlines()) <= PLAIN_MAX_LINES + 2 and LOOP in out


def test_show_source_displays_html_in_jupyter(monkeypatch):
    shown = []
    monkeypatch.setattr(show, "_html_front_end", lambda: True)
    monkeypatch.setattr("IPython.display.display", shown.append)
    show_source(KERNEL_PATH, 1, 5)
    assert len(shown) == 1 and shown[0]._repr_html_().startswith("<details>")


def test_python_objects_and_relative_paths():
    v = source_view(source_view)
    assert v.name == "course_utils/publishing/show.py" and v.lines[0].startswith("def source_view(")
    assert source_view("course_utils/publishing/show.py", 1, 1).lines[0].startswith('"""')


def test_bad_markers_and_ranges_say_what_is_wrong():
    with pytest.raises(ValueError, match="no line of"):
        source_view(KERNEL_PATH, start="no such text anywhere")
    with pytest.raises(ValueError, match="has .* lines"):
        source_view(KERNEL_PATH, 10, 5)
