"""Answer extraction from model text and gold-answer normalisation.

Pure string work, no math-verify: the verifier (`anytime.reward.verifier`) extracts answers in the parent
process (so it can verify each distinct answer once) and normalises them for math-verify inside its
killable worker processes; tests/callers can use them anywhere. Extraction follows the
AnytimeReasoner paper: split the answer part on blank lines, take the first paragraph that starts
with the answer header, and read the last balanced ``\\boxed{...}`` of that paragraph.

Model text is untrusted, so every step is a bounded number of linear passes (regexes without
nested repetition, no backtracking blow-up) and the amount of text that reaches the (expensive,
potentially super-linear) math parser is capped.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence

from anytime import defaults

# The one end-of-thinking marker and answer header (`anytime.defaults`); the header as the verifier
# looks for it, without the blank lines around it.
THINK_END = defaults.THINK_END
DEFAULT_HEADER = defaults.HEADER.strip()

# A \boxed{} answer longer than this is not a final answer but garbage (or an attack on the
# parser): it is treated as "no answer" instead of being handed to sympy.
MAX_ANSWER_CHARS = 4096
# Only the tail of an over-long header paragraph is searched. Brace matching is local (a "{" is
# closed by the first depth-balanced "}" after it), so every \boxed that starts inside the tail
# is matched exactly as in the full paragraph; honest summaries are far shorter than this.
MAX_PARAGRAPH_CHARS = 16384

# "\boxed{" / "\fbox{" (optional spaces before the brace) or "\boxed 5" (the token form some
# models emit), an escaped brace "\{" or a line break "\\" (skipped: not grouping), or a brace.
# "\boxed" followed by a letter ("\boxedx") is another macro and matches nothing.
_TOKEN_RE = re.compile(r"\\(?:boxed|fbox)(?:\s*(\{)|\s+([^\s{}$\\]+))|\\[\\{}]|[{}]")
# An unescaped "$" (math delimiter); "\$" (a dollar sign) is kept.
_DOLLAR_RE = re.compile(r"(?<!\\)\$")
# An answer that is one number in scientific notation, "3.89e-10" (Minerva golds; math-verify
# reads it as 3.89*e - 10) or "8.7 \times 10^{8}", optionally followed by a unit ("\text{ m}",
# " Hz"). What follows must not bind tighter than the product ("10^{8}5", "10^8!", "10^{8}^2").
_SCIENTIFIC_RE = re.compile(
    r"(?P<sign>[-+]?)(?P<mantissa>\d+(?:\.\d*)?|\.\d+)"
    r"(?:[eE](?P<e>[-+]?\d+)"
    r"|\s*(?:\\times|\\cdot|[*\u00d7\u00b7])\s*10\s*\^\s*(?:\{\s*(?P<braced>[-+]?\d+)\s*\}|(?P<digit>\d)))"
    r"(?P<unit>(?:(?=[\s\\A-Za-z])(?!\s*[\^_!'])\S?.*)?)",
    re.DOTALL,
)
# Positive powers of ten up to this are written out exactly ("870000000"): math-verify compares a
# float mantissa times a power (8.7*10**8) with an integer exactly and rejects 870000000.
_MAX_EXPANDED_EXPONENT = 400
# A degree sign, also as a superscript ("90°", "90^°", "90^{°}"): math-verify drops "^\circ" but
# not "°", so "1950° C" parsed as 1950 against the gold "1950^\circ C".
_DEGREE_RE = re.compile(r"(?:\^\s*)?(?:\{\s*\u00b0\s*\}|\u00b0)")
# For the string comparison math-verify falls back on when it cannot parse an answer: a run of
# white space between two letters or digits separates tokens ("\max x", "\text{a b}") and is kept
# as one space, elsewhere it is layout ("E_1, E_2", "m_{\max }") and is dropped; "\ " is kept.
_SPACES_RE = re.compile(r"\s+")
_LAYOUT_SPACE_RE = re.compile(r"(?<![^\W_])(?<!\\) |(?<=[^\W_]) (?![^\W_])")
# A one-character group after ^ or _ is the character itself: "n^{2}" is "n^2".
_SINGLE_GROUP_RE = re.compile(r"([\^_])\{([^\W_])\}")


def sanitize(text: str) -> str:
    """Drop NUL bytes and replace lone surrogates so every later step sees valid Unicode."""
    if "\x00" in text:
        text = text.replace("\x00", "")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates, e.g. "\ud800" from a bad detokenisation
        text = text.encode("utf-8", errors="replace").decode("utf-8")
    return text


def extract_boxed(text: str, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    """Return the content of the last balanced ``\\boxed{...}`` in ``text`` (None if there is none).

    "Last" is the one that closes last, so for ``\\boxed{\\boxed{1}}`` the outer content is
    returned. Unbalanced openers are skipped (an earlier balanced box still counts); content longer
    than ``max_chars`` gives None. ``\\boxed 5`` (no braces) yields ``"5"``. One regex pass plus a
    stack: linear time even for 10,000 nested braces or a thousand boxes.
    """
    if len(text) > MAX_PARAGRAPH_CHARS:
        text = text[-MAX_PARAGRAPH_CHARS:]
    stack: list[int] = []  # content start offset for \boxed{, -1 for a plain brace
    best: tuple[int, int] | None = None  # (content start, content end) of the last closed box
    for match in _TOKEN_RE.finditer(text):
        if match.group(1) is not None:  # \boxed{
            stack.append(match.end())
        elif match.group(2) is not None:  # \boxed token
            best = (match.start(2), match.end(2))
        elif match.group(0)[0] == "\\":  # "\{", "\}" or "\\"
            continue
        elif match.group(0) == "{":
            stack.append(-1)
        elif stack:  # "}" closing something; a stray "}" is ignored
            start = stack.pop()
            if start >= 0:
                best = (start, match.start())
    if best is None:
        return None
    start, end = best
    if end - start > max_chars:
        return None
    return text[start:end].strip()


def header_key(header: str) -> str:
    """The header as matched: surrounding whitespace stripped (the forced text may be
    ``"\\n\\n**Final Answer**\\n"``). Raises ValueError for a blank header."""
    if not isinstance(header, str) or not header.strip():
        raise ValueError(
            f"answer header must be a non-blank string such as {DEFAULT_HEADER!r}, got {header!r}"
        )
    return header.strip()


def extract_answer(text: str, header: str = DEFAULT_HEADER) -> str | None:
    """The last ``\\boxed{}`` content of the first paragraph (split on blank lines) that starts
    with ``header``; None if no paragraph starts with it or that paragraph has no box.

    ``text`` is the answer part (after the thinking); only the header paragraph is searched, as in
    the paper, so a box in a later paragraph does not count. The header itself is part of the search,
    so a header that ends in ``\\boxed{`` has its box closed by the model's answer.
    """
    key = header_key(header)
    for paragraph in sanitize(text).split("\n\n"):
        if paragraph.lstrip().startswith(key):
            # From the header's start, not its end: a header may open the box itself
            # ("**Final Answer**\n\\boxed{"), so the model writes only the answer and "}".
            return extract_boxed(paragraph.lstrip())
    return None


def strip_math_delimiters(answer: str) -> str:
    """Remove unescaped ``$`` delimiters and a trailing full stop: ``"$69$,$84$"`` -> ``"69,84"``.

    Datasets (OlympiadBench) write multi-part golds as several ``$...$`` pieces; the answer is then
    re-wrapped once as ``$...$`` for math-verify, which does not parse bare LaTeX. ``\\$`` (a
    currency sign) is kept.
    """
    answer = _DOLLAR_RE.sub("", answer).strip()
    if answer.endswith(".") and not answer.endswith(".."):
        answer = answer[:-1].rstrip()
    return answer


def _expand_power_of_ten(mantissa: str, exponent: int) -> str:
    """``mantissa * 10**exponent`` (exponent >= 0) written out exactly: ``("8.7", 8)`` ->
    ``"870000000"``, ``("2.7778", 2)`` -> ``"277.78"``. String arithmetic, no float rounding."""
    whole, _, fraction = mantissa.partition(".")
    digits, point = whole + fraction, len(whole) + exponent
    integer = digits[:point].ljust(point, "0").lstrip("0") or "0"
    fraction = digits[point:].rstrip("0")
    return f"{integer}.{fraction}" if fraction else integer


def _scientific(answer: str) -> str:
    """A number in E notation or as ``m \\times 10^{e}`` (whole answer, optional unit after it):
    written out when ``e >= 0`` (exactly, so "870000000" matches "8.7 \\times 10^{8}"), else as
    ``m \\times 10^{e}``; anything else is returned unchanged."""
    number = _SCIENTIFIC_RE.fullmatch(answer)
    if number is None:
        return answer
    exponent = number.group("e") or number.group("braced") or number.group("digit")
    sign, mantissa, unit = number.group("sign"), number.group("mantissa"), number.group("unit")
    # The length check comes first: no int() of a 4,000-digit exponent.
    if len(exponent.lstrip("+-").lstrip("0")) <= 3 and 0 <= int(exponent) <= _MAX_EXPANDED_EXPONENT:
        return f"{sign}{_expand_power_of_ten(mantissa, int(exponent))}{unit}"
    if number.group("e") is not None:
        return f"{sign}{mantissa} \\times 10^{{{exponent}}}{unit}"
    return answer


def as_latex(answer: str) -> str:
    """The math-verify input for a gold or a predicted answer: delimiters stripped, scientific
    notation written out (positive powers) or spelled as a power of ten (E notation), degree signs
    as ``^{\\circ}``, wrapped once in ``$...$`` (bare LaTeX such as ``(x+1)^2`` parses to nothing
    and ``2^{1/2}`` to 2). Gold and prediction go through the same function; every step is one
    linear regex pass."""
    answer = _scientific(strip_math_delimiters(answer))
    answer = _DEGREE_RE.sub(r"^{\\circ}", answer)
    return f"${answer}$"


def canonical_spacing(latex: str) -> str:
    """``latex`` with layout white space dropped and one-character groups unbraced, for string
    comparison only: ``"E_1, E_2"`` and ``"E_1,E_2"``, ``"m_{\\max }=n^{2}"`` and
    ``"m_{\\max}=n^2"`` become equal; ``"\\max x"`` keeps its space."""
    latex = _SPACES_RE.sub(" ", latex)
    return _SINGLE_GROUP_RE.sub(r"\1\2", _LAYOUT_SPACE_RE.sub("", latex))


def _normalize_scalar(answer: object) -> str:
    if isinstance(answer, bool):  # bool is an int subclass; True is not an answer
        raise ValueError(f"gold answer must be a number, string or list, got the bool {answer!r}")
    if isinstance(answer, numbers.Integral):
        return str(int(answer))
    if isinstance(answer, numbers.Real):
        value = float(answer)
        if not math.isfinite(value):
            raise ValueError(f"gold answer must be finite, got {answer!r}")
        # 142.0 -> "142": AMC stores integer answers as floats.
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(answer, str):
        return strip_math_delimiters(answer)
    raise ValueError(
        f"gold answer must be a number, string or list of them, got {type(answer).__name__}: "
        f"{answer!r:.80}"
    )


def normalize_gold(answer: object) -> list[str]:
    """Turn a dataset's answer field into a non-empty list of gold strings.

    Floats with an integral value become integers (``142.0`` -> ``"142"``), lists give one gold per
    element (a prediction is correct if it matches any), strings lose surrounding whitespace
    (Minerva's trailing newlines) and ``$`` delimiters. The strings are bare LaTeX, readable in
    logs; `as_latex` turns them into math-verify input. Raises ValueError for a missing or empty
    answer.
    """
    items: Sequence[object] = answer if isinstance(answer, (list, tuple)) else [answer]
    golds = [gold for gold in (_normalize_scalar(item) for item in items) if gold]
    if not golds:
        raise ValueError(
            f"gold answer is empty ({answer!r:.80}); every dataset row needs a non-empty answer"
        )
    return golds
