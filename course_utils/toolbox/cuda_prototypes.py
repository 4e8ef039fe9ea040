"""A small C++ scanner for CUDA sources: comments and literals masked, function definitions found
at namespace scope, and the C++ prototypes of the host functions that load_cuda binds to Python.

It reads text only (no compiler, no torch) and knows nothing of builds or reports, which is what
makes it its own room; the kernel parameters that compile_kernel checks are read with it too
(course_utils.toolbox.cuda_kernel).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


def _mask_source(src: str) -> tuple[str, str]:
    """Two copies of ``src`` with every character at its place (newlines kept):

    ``clean``: comments and preprocessor lines blanked; string literals kept.
    ``skeleton``: like ``clean``, and the insides of string and char literals blanked too, so
    braces and parentheses in it are all real C++ structure.
    """
    clean = list(src)
    skel = list(src)
    n = len(src)
    i = 0
    line_start = True  # only whitespace so far on this line

    def blank(a: int, b: int, *, keep_in_clean: bool = False) -> None:
        for j in range(a, b):
            if src[j] != "\n":
                skel[j] = " "
                if not keep_in_clean:
                    clean[j] = " "

    while i < n:
        c = src[i]
        nxt = src[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            end = src.find("\n", i)
            end = n if end < 0 else end
            blank(i, end)
            i = end
        elif c == "/" and nxt == "*":
            end = src.find("*/", i + 2)
            end = n if end < 0 else end + 2
            blank(i, end)
            i = end
        elif c == "#" and line_start:
            j = i
            while j < n and src[j] != "\n":  # a directive runs on past backslash-newlines
                j = j + 2 if src[j] == "\\" and j + 1 < n else j + 1
            blank(i, j)
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and src[i - 1].isalnum() and nxt.isalnum():
                i += 1  # a digit separator: 1'000'000
                continue
            j = i + 1
            while j < n and src[j] != c and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            blank(i + 1, min(j, n), keep_in_clean=True)
            i = j + 1
        else:
            i += 1
            line_start = (line_start and c in " \t") or c == "\n"
            continue
        line_start = False
    return "".join(clean), "".join(skel)


def _matching(text: str, start: int, open_ch: str = "(", close_ch: str = ")") -> int:
    """Index of the bracket that closes the one at ``start``, or -1."""
    depth = 0
    for j in range(start, len(text)):
        if text[j] == open_ch:
            depth += 1
        elif text[j] == close_ch:
            depth -= 1
            if depth == 0:
                return j
    return -1


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split at ``sep`` outside (), [], {} and <> (template brackets)."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _squash(text: str) -> str:
    return " ".join(text.split())


@dataclass(frozen=True)
class _FunctionDef:
    name: str
    prefix: str  # everything before the name: "template <int N> __global__ void"
    params: str  # the text between the parentheses
    line: int  # 1-based line of the name in the source
    namespace: str  # "" at file scope

    @property
    def words(self) -> list[str]:
        return re.findall(r"[A-Za-z_]\w*", self.prefix)

    @property
    def is_kernel(self) -> bool:
        return "__global__" in self.words

    @property
    def is_device_only(self) -> bool:
        return "__device__" in self.words and "__host__" not in self.words

    @property
    def template_params(self) -> str | None:
        m = re.search(r"\btemplate\s*<", self.prefix)
        if not m:
            return None
        close = _matching(self.prefix, m.end() - 1, "<", ">")
        return self.prefix[m.end() : close] if close > 0 else ""


_CALL_RE = re.compile(r"\b([A-Za-z_]\w*)\s*\(")
_TRAILING_QUALIFIERS_RE = re.compile(r"^[\s\w:]*(->[^;{}]*)?$")  # const, noexcept, -> T


def _function_definitions(source: str) -> list[_FunctionDef]:
    """Every function defined (with a body) at namespace scope, in source order."""
    clean, skel = _mask_source(source)
    defs: list[_FunctionDef] = []
    namespaces: list[str] = []  # enclosing namespace (or extern "C" block, named "") names
    block_depth = 0  # braces of function bodies, structs, initialisers
    boundary = 0  # start of the current declaration at namespace scope
    for i, c in enumerate(skel):
        if c == "{":
            if block_depth:
                block_depth += 1
                continue
            head = skel[boundary:i]
            ns = re.search(r"\bnamespace\s*([\w:]*)\s*$", head)
            if ns or re.search(r'\bextern\s*"\s*"\s*$', head):
                namespaces.append((ns.group(1) or "(anonymous)") if ns else "")
                boundary = i + 1
                continue
            block_depth = 1
            for m in _CALL_RE.finditer(head):
                close = _matching(head, m.end() - 1)
                if close < 0 or not _TRAILING_QUALIFIERS_RE.match(head[close + 1 :]):
                    continue
                start = boundary + m.start(1)
                defs.append(
                    _FunctionDef(
                        name=m.group(1),
                        prefix=_squash(clean[boundary:start]),
                        params=_squash(clean[boundary + m.end() : boundary + close]),
                        line=skel.count("\n", 0, start) + 1,
                        namespace="::".join(n for n in namespaces if n),
                    )
                )
                break
        elif c == "}":
            if block_depth:
                block_depth -= 1
            elif namespaces:
                namespaces.pop()
            if not block_depth:
                boundary = i + 1
        elif c == ";" and not block_depth:
            boundary = i + 1
    return defs


def _default_argument(param: str) -> bool:
    """True when a parameter declaration has a default value (an ``=`` outside brackets)."""
    depth = 0
    for j, ch in enumerate(param):
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == "=" and depth == 0:
            before = param[j - 1] if j else ""
            after = param[j + 1] if j + 1 < len(param) else ""
            if before not in "=!<>" and after != "=":
                return True
    return False


def cpp_prototypes(source: str, functions) -> list[str]:
    """The C++ declarations of the host functions ``functions`` (list of str), read off
    ``source`` (CUDA C++ text), e.g. ``["torch::Tensor vector_add(torch::Tensor x, ...);"]``.

    A signature may span several lines. Raises ValueError when a function is not defined in the
    source (the message lists the host functions that are), is a kernel or device function, a
    template, overloaded, inside a namespace, ``static``/``inline``, or has default arguments.
    """
    if isinstance(functions, str):
        functions = [functions]
    defs = _function_definitions(source)
    host = [
        d
        for d in defs
        if not (d.is_kernel or d.is_device_only or d.namespace or d.template_params is not None)
    ]
    prototypes = []
    for fn in functions:
        matches = [d for d in defs if d.name == fn]
        if not matches:
            names = ", ".join(dict.fromkeys(d.name for d in host)) or "none"
            raise ValueError(
                f"function {fn!r} is not defined in the CUDA source; defined host functions "
                f"are: {names}. Check the spelling, or write a host function that takes and "
                "returns torch::Tensor and launches your kernel."
            )
        if len(matches) > 1:
            lines = ", ".join(str(d.line) for d in matches)
            raise ValueError(
                f"function {fn!r} is defined {len(matches)} times (lines {lines}); Python "
                "bindings need one definition per name: give the overloads different names."
            )
        d = matches[0]
        if d.is_kernel:
            raise ValueError(
                f"{fn!r} (line {d.line}) is a __global__ kernel; load_cuda binds host functions "
                "that take torch tensors and launch kernels. Write a wrapper such as "
                f"`torch::Tensor {fn}_launch(torch::Tensor x) {{ ...; {fn}<<<grid, block>>>(...);"
                " ... }` and list that name instead (or use compile_kernel to launch the kernel "
                "directly)."
            )
        if d.is_device_only:
            raise ValueError(
                f"{fn!r} (line {d.line}) is a __device__ function: it runs on the GPU and "
                "cannot be called from Python. List a host function instead."
            )
        if d.template_params is not None:
            raise ValueError(
                f"{fn!r} (line {d.line}) is a template; Python can only call a concrete "
                "function: write a non-template wrapper that calls the instantiation you need."
            )
        if d.namespace:
            raise ValueError(
                f"{fn!r} (line {d.line}) is defined inside namespace {d.namespace!r}; define the "
                "functions you bind to Python at file scope (outside any namespace)."
            )
        for word in ("static", "inline", "__forceinline__"):
            if word in d.words:
                raise ValueError(
                    f"{fn!r} (line {d.line}) is declared `{word}`, so the generated binding "
                    f"code in another file cannot call it: remove `{word}`."
                )
        for param in _split_top_level(d.params):
            if _default_argument(param):
                raise ValueError(
                    f"{fn!r} (line {d.line}) has a default argument (`{param}`): load_cuda "
                    "derives the C++ prototype from the source and does not support default "
                    "arguments. Remove the default and pass the value from Python."
                )
        prefix = " ".join(w for w in d.prefix.split() if w != "__host__")
        prototypes.append(f"{prefix} {fn}({d.params});")
    return prototypes
