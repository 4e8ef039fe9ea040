"""Compile errors made readable: each error of an nvcc, NVRTC, g++ or ptxas log found and shown
beside the offending line of the student's own source (its line numbers, not a generated file's),
then the end of the raw log, raised as CudaCompileError.

Every way of compiling (course_utils.toolbox.cuda_build, cuda_nvrtc) ends here on failure; the
room reads logs and sources only, and imports no other cuda room.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

CONTEXT_LINES = 2  # source lines shown above and below an offending line
MAX_ERRORS_SHOWN = 8  # a cascade of follow-on errors teaches nothing after the first few
LOG_TAIL_LINES = 30  # raw compiler log lines kept at the end of a CudaCompileError
LOG_LINE_MAX_CHARS = 400  # ninja echoes whole command lines; keep the log readable


class CudaCompileError(RuntimeError):
    """A CUDA source did not compile.

    The message lists each error beside the offending lines of your source, then the tail of the
    raw compiler log. ``.log`` holds the whole log, ``.errors`` the parsed errors as
    ``(line_in_your_source_or_None, message)`` tuples.
    """

    def __init__(self, message: str, *, log: str = "", errors=()):
        super().__init__(message)
        self.log = log
        self.errors = list(errors)


_NV_DIAG_RE = re.compile(  # nvcc and NVRTC: file(LINE): error: message
    r"^(?P<file>[^\s(][^(\n]*?)\((?P<line>\d+)\):\s*(?P<sev>catastrophic error|error|warning)"
    r"(?:\s*#[\w-]+)?:\s*(?P<msg>.*)$"
)
_GCC_DIAG_RE = re.compile(  # g++: file:LINE:COL: error: message
    r"^(?P<file>[^\s:][^:\n]*?):(?P<line>\d+):(?:\d+:)?\s*(?P<sev>fatal error|error|warning):"
    r"\s*(?P<msg>.*)$"
)
_PTXAS_ERR_RE = re.compile(r"^ptxas\s+(?:fatal|error)\s*:\s*(?P<msg>.*)$")


@dataclass(frozen=True)
class _Diagnostic:
    file: str | None
    line: int | None
    message: str


def _parse_diagnostics(log: str) -> list[_Diagnostic]:
    """Errors (not warnings) in an nvcc / NVRTC / g++ / ptxas log, in order, without repeats."""
    found: list[_Diagnostic] = []
    lines = log.splitlines()
    for k, raw in enumerate(lines):
        line = raw.strip()
        m = _NV_DIAG_RE.match(line) or _GCC_DIAG_RE.match(line)
        if m:
            if m.group("sev") == "warning":
                continue
            msg = m.group("msg").strip()
            # nvcc continues some messages on deeply indented lines ("argument types are: ...")
            for more in lines[k + 1 : k + 4]:
                if more.startswith(" " * 10) and more.strip():
                    msg += " " + more.strip()
                else:
                    break
            diag = _Diagnostic(m.group("file").strip(), int(m.group("line")), msg)
        else:
            m = _PTXAS_ERR_RE.match(line)
            if not m:
                continue
            diag = _Diagnostic(None, None, "ptxas: " + m.group("msg").strip())
        if diag not in found:
            found.append(diag)
    return found


def _line_offset_in(path: str, source: str) -> int | None:
    """How many lines precede ``source`` inside the file at ``path`` (None if it is not there).

    load_inline writes the student's text into its own cuda.cu after a few #include lines, so a
    compiler line number minus this offset is a line number of the student's source.
    """
    try:
        written = Path(path).read_text()
    except OSError:
        return None
    at = written.find(source)
    if at < 0:
        at = written.find(source[:200]) if source.strip() else -1
    return None if at < 0 else written.count("\n", 0, at)


_LINE_DIRECTIVE = re.compile(r'^\s*#\s*line\s+(\d+)(?:\s+"([^"]*)")?\s*$')


def _file_lines(text: str, name: str) -> list[str]:
    """The lines of file ``name`` in ``text``, undoing the ``#line`` directives with which
    _inline_local_includes put headers in place (text without them: its own lines)."""
    lines: dict[int, str] = {}
    current, number = name, 1
    for raw in text.splitlines():
        m = _LINE_DIRECTIVE.match(raw)
        if m:
            number, current = int(m.group(1)), m.group(2) or current
            continue
        if current == name:
            lines[number] = raw
        number += 1
    return [lines.get(k, "") for k in range(1, max(lines, default=0) + 1)]


def _excerpt(text: str, line: int, marker: str = ">", name: str = "<source>") -> str:
    lines = _file_lines(text, name) if "#line" in text else text.splitlines()
    lo, hi = max(1, line - CONTEXT_LINES), min(len(lines), line + CONTEXT_LINES)
    width = len(str(hi))
    out = []
    for k in range(lo, hi + 1):
        mark = marker if k == line else " "
        out.append(f"  {mark} {k:>{width}} | {lines[k - 1]}")
    return "\n".join(out)


def _log_tail(log: str) -> str:
    lines = [
        ln if len(ln) <= LOG_LINE_MAX_CHARS else ln[:LOG_LINE_MAX_CHARS] + " ..."
        for ln in log.rstrip().splitlines()[-LOG_TAIL_LINES:]
    ]
    return "\n".join(lines)


def _where(display_name: str, line: int | None = None) -> str:
    if display_name == "<source>":
        return "your source" if line is None else f"line {line} of your source"
    return f"your source {display_name}" if line is None else f"{display_name}, line {line}"


def _compile_error(
    log: str,
    source: str,
    *,
    tool: str,
    display_name: str,
    source_files: tuple[str, ...] = (),
) -> CudaCompileError:
    """Build the CudaCompileError for a failed compile.

    ``source_files``: names under which the compiler saw the student's text unchanged (line 1 is
    line 1). Any other file the log names is read, if it exists, and searched for the text.
    """
    diagnostics = _parse_diagnostics(log)
    offsets: dict[str, int | None] = {}
    parts, errors = [], []
    for d in diagnostics[:MAX_ERRORS_SHOWN]:
        student_line = None
        if d.file is not None:
            if d.file not in offsets:
                known = d.file in source_files or Path(d.file).name in source_files
                offsets[d.file] = 0 if known else _line_offset_in(d.file, source)
            offset = offsets[d.file]
            if offset is not None and 0 < d.line - offset <= len(source.splitlines()):
                student_line = d.line - offset
        errors.append((student_line, d.message))
        if student_line is not None:
            parts.append(
                f"error: {d.message}\n  --> {_where(display_name, student_line)}\n"
                + _excerpt(source, student_line, name=display_name)
            )
        elif d.file is not None and Path(d.file).name == "main.cpp":
            parts.append(
                f"error in the generated bindings (main.cpp line {d.line}): {d.message}\n"
                "  (main.cpp declares your host functions with the prototypes load_cuda read "
                "off your source; check their parameter and return types)"
            )
        elif d.file is not None:
            parts.append(f"error in {d.file}, line {d.line}: {d.message}")
        else:
            parts.append(f"error: {d.message}")
    n_mine = sum(1 for line, _ in errors if line is not None)
    if diagnostics:
        more = len(diagnostics) - MAX_ERRORS_SHOWN
        head = (
            f"CUDA compilation failed ({tool}): {len(diagnostics)} error(s), "
            f"{n_mine} of them in {_where(display_name)}."
        )
        body = "\n\n".join(parts) + (f"\n\n... and {more} more error(s)" if more > 0 else "")
    else:
        head = f"CUDA compilation failed ({tool}); no error line could be found in the log."
        body = ""
    hint = ""
    if re.search(r"(?:could not|cannot) open source file", log):
        hint = (
            "\n\nhint: the compiler could not find a header. NVRTC (compile_kernel) compiles "
            "device code only: no torch headers; for cuda_fp16.h and friends it needs NVRTC "
            ">= 13.3 (pip install -U nvidia-cuda-nvrtc) or a CUDA toolkit (set CUDA_HOME)."
        )
    message = f"{head}\n\n{body}{hint}\n\n--- end of the compiler log ---\n{_log_tail(log)}"
    return CudaCompileError(message.replace("\n\n\n\n", "\n\n"), log=log, errors=errors)
