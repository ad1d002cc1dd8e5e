"""Text fields of a request must be valid Unicode.

JSON may spell a lone UTF-16 surrogate (``"\\ud800"``: half of a pair, or a stray low
half), and Python's ``json`` decodes it into a ``str`` that is not Unicode text: the
tokenizer refuses it (``TypeError``), UTF-8 cannot encode it, and no generated text can
ever contain it. A valid pair (``"\\ud83d\\ude00"``) decodes to one character (U+1F600)
and is fine, as are NUL and every other code point.

Every text field the server uses is checked while the body is validated, so a client
gets a 400 naming the field instead of a 500 from inside the tokenizer.
"""

from __future__ import annotations


def check_unicode(text: str, what: str) -> str:
    """Return ``text`` if it holds no lone surrogate; else raise ValueError saying which
    text (``what``, e.g. ``"prompt 1"``) and where."""
    if text.isascii():  # the common case, and no surrogate can hide in it
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        # Only surrogates (U+D800..U+DFFF) fail to encode to UTF-8; name the first one
        # as an escape, since the character itself cannot be printed.
        position = exc.start
        raise ValueError(
            f"{what} has a lone UTF-16 surrogate (\\u{ord(text[position]):04x}) at "
            f"character {position}, which is not valid Unicode text") from None
    return text
