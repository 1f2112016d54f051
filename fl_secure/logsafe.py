r"""Text a peer chose, made safe to write into a log line.

A client id, a metric name or the text of a refused message may carry newlines (a forged
second log line), terminal escape codes (ESC ``\x1b[...``: recoloured or erased lines on an
operator's terminal) or bidirectional overrides. :func:`safe` escapes every character that is
not printable, and the backslash itself, so what the log shows is unambiguous and on one line.
"""

from __future__ import annotations

#: At most this many characters of one value reach the log (the rest is elided).
MAX_LOGGED_CHARS = 300


def safe(value: object, limit: int = MAX_LOGGED_CHARS) -> str:
    r"""``value`` as one printable line: control characters escaped, cut at ``limit`` chars.

    A newline comes out as the two characters ``\n``, ESC as ``\x1b``, a bidirectional
    override as ``\u202e``.
    """
    text = str(value)
    cut = len(text) > limit
    out = []
    for ch in text[:limit]:
        if ch == "\\":
            out.append("\\\\")
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out) + (f"... ({len(text)} chars)" if cut else "")
