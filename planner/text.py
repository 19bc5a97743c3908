"""Text that reaches a terminal or a page: what counts as printable, and how the rest is shown.

A model id travels from an HTTP request into the store and later onto an operator's terminal
(``planner history``, ``planner show``): an ESC byte there would be a terminal control sequence
(clear the screen, set the window title, move the cursor), a newline a forged line. So ids are
refused unless printable where they come in (``planner.limits.check_model_id``) and every stored
string is shown through ``visible`` where it goes out (rows stored before the check, measurement
errors that are several lines by nature).

"Printable" is Python's ``str.isprintable``: no control characters (C0, DEL, C1), no format
characters (bidi overrides such as U+202E, zero-width joiners), no line or paragraph separators
and no space other than U+0020. Letters of any script are printable.

No imports: the CLI, the planning path and the service all use it.
"""

from __future__ import annotations

#: how ``visible`` writes the usual control characters (as Python and C write them)
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\0": "\\0"}


def first_unprintable(text: str) -> int | None:
    """Index of the first character of ``text`` that is not printable, or None."""
    if text.isprintable():  # the common case, in C
        return None
    return next(i for i, ch in enumerate(text) if not ch.isprintable())


def codepoint(ch: str) -> str:
    """``U+001B``: a character named by its code point (it may not print)."""
    return f"U+{ord(ch):04X}"


def _escape(ch: str) -> str:
    if ch in _SHORT:
        return _SHORT[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def visible(text: object) -> str:
    """``text`` with every unprintable character written as its escape (``\\x1b``, ``\\n``,
    ``\\u202e``): safe to write to a terminal, one line, and nothing lost to the reader."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def check_printable(text: str, *, what: str) -> str | None:
    """One line saying why ``text`` is not printable (``what`` names it), or None when it is."""
    at = first_unprintable(text)
    if at is None:
        return None
    return (f"{what} holds the unprintable character {codepoint(text[at])} ({_escape(text[at])}) at position "
            f"{at + 1}: only printable text is accepted (no control characters, newlines or tabs)")


__all__ = ["check_printable", "codepoint", "first_unprintable", "visible"]
