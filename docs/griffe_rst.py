"""A Griffe extension (mkdocs.yml, mkdocstrings' ``extensions``): the package's docstrings use two
reStructuredText habits that Markdown would show as written; this turns them into Markdown before
mkdocstrings renders the API reference.

- Roles: ``:class:`~a.b.C``` becomes ```C```, ``:func:`a.b``` becomes ```a.b```.
- Literal blocks: a line ending in ``::`` followed by an indented block becomes the line with one
  colon and the block in a fenced code block (``Example::`` becomes a Google ``Example:`` section).
"""
import re
from typing import Any, List

from griffe import Extension

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|py:\w+):`(~?)([^`]+)`")
SECTION = re.compile(r"^\s*(Examples?|Notes?|Warnings?)$")   # Google section titles


def _role(match: "re.Match[str]") -> str:
    target = match.group(2).strip()
    if match.group(1):                          # ~a.b.C: the last part only
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def roles_to_markdown(text: str) -> str:
    """``:class:`~a.b.C``` -> ```C```, ``:func:`a.b``` -> ```a.b``` (the roles only)."""
    return ROLE.sub(_role, text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def to_markdown(text: str) -> str:
    lines = roles_to_markdown(text).split("\n")
    out: List[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.rstrip().endswith("::"):
            out.append(line)
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == len(lines) or _indent(lines[j]) <= _indent(line):
            out.append(line.rstrip()[:-1])      # "::" with no block after it
            i += 1
            continue
        block_indent = _indent(lines[j])
        k = j
        while k < len(lines) and (not lines[k].strip() or _indent(lines[k]) >= block_indent):
            k += 1
        while k > j and not lines[k - 1].strip():
            k -= 1
        head = line.rstrip()[:-1]
        if head.strip() == ":":                 # a bare "::" line
            head = ""
        if SECTION.match(head.rstrip(":")):     # "Example:": the fence is the section's content
            fence, cut, gap = " " * block_indent, 0, []
        else:                                   # prose: the fence at the paragraph's indent
            fence, cut, gap = " " * _indent(line), block_indent - _indent(line), [""]
        out += [head] + gap + [fence + "```python"]
        out += [code[cut:] if code.strip() else "" for code in lines[j:k]]
        out += [fence + "```"]
        i = k
    return "\n".join(out)


class RestToMarkdown(Extension):
    """Rewrite every docstring as it is loaded."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
