"""One spelling per local part: the least quoted one (RFC 5321 section 4.1.2).

A local part is a Dot-string or a Quoted-string, and RFC 5322 section 3.2.4 makes a
quoted-string "identical to atom, semantically": ``"bob"@example.net`` and
``bob@example.net`` are one mailbox (section 3.4.1), and so is ``"b\\ob"@example.net``.
Kept as given, each spelling would be its own recipient, delivered to once each, and a
suppression list would miss the other spellings of a listed address.  So every way in
(the SMTP receiver's MAIL and RCPT, the HTTP API's envelope) stores ``canonical_address``,
and the suppression list compares in it.

The canonical spelling is the one RFC 5321 section 4.1.2 asks senders for ("SHOULD NOT"
quote a local part that does not need it), and what Postfix rewrites to: the content of a
quoted-string, its quoted-pairs undone, unquoted when it is a dot-atom (RFC 5322 section
3.2.3 atext, with the non-ASCII that RFC 6531 section 3.3 adds for SMTPUTF8); otherwise
quoted again with only ``"`` and ``\\`` escaped, the two characters qtextSMTP leaves out.
Everything else is left as given: an unquoted local part, the case of the letters (the
remote host's business, RFC 5321 section 2.4), and text that is not one whole
quoted-string (``"a"b"``) or holds a control character, which no SMTP spelling carries.

``is_local_part`` is the one syntax check of a local part, for the same ways in: a
Dot-string or a Quoted-string (RFC 5321 section 4.1.2), so ``a@b@c`` (the old
user@host@relay routing) is no mailbox anywhere.

Pure: no I/O.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["canonical_address", "canonical_local", "is_local_part"]

_ATEXT: Final = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~\-\u0080-\U0010ffff]"
_DOT_ATOM: Final = re.compile(rf"{_ATEXT}+(?:\.{_ATEXT}+)*")
# RFC 5322 section 3.2.4: DQUOTE *(qtext / quoted-pair) DQUOTE; a quoted-pair is a
# backslash and the character it quotes.  Controls are refused below, not here.
_QUOTED_STRING: Final = re.compile(r'"((?:[^"\\]|\\.)*)"', re.DOTALL)
_QUOTED_PAIR: Final = re.compile(r"\\(.)", re.DOTALL)
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")
# RFC 5321 section 4.1.2: Local-part = Dot-string / Quoted-string.  The Dot-string is read
# loosely (atext and dots in any order: a dot first, last or doubled is the owning
# domain's business, and real mailboxes have them); the Quoted-string's content is any
# character but a control, with '"' and '\' only as quoted-pairs (qtextSMTP and
# quoted-pairSMTP, and RFC 6531 section 3.3's non-ASCII).
_LOCAL_PART: Final = re.compile(rf'(?:{_ATEXT}|\.)+|"(?:[^"\\\x00-\x1f\x7f]|\\[^\x00-\x1f\x7f])*"')


def canonical_local(local: str) -> str:
    """``local`` in its least quoted spelling (see the module docstring): ``"bob"`` is
    ``bob``, ``"a\\ b"`` is ``"a b"``, ``".bob"`` stays as it is."""
    whole = _QUOTED_STRING.fullmatch(local)
    if whole is None:
        return local
    content = _QUOTED_PAIR.sub(r"\1", whole.group(1))
    if _CONTROL.search(content) is not None:
        return local
    if _DOT_ATOM.fullmatch(content):
        return content
    return '"' + content.replace("\\", "\\\\").replace('"', '\\"') + '"'


def is_local_part(local: str) -> bool:
    """Whether ``local`` is a local part as RFC 5321 section 4.1.2 has it (with RFC 6531
    section 3.3's non-ASCII; whether SMTPUTF8 allows that is the caller's question): one
    regex match, on the SMTP receiver's RCPT hot path."""
    return _LOCAL_PART.fullmatch(local) is not None


def canonical_address(address: str) -> str:
    """``address`` with its local part (before the last ``@``) in ``canonical_local``'s
    spelling; the domain as given, an address without ``@`` (``Postmaster``) as it is."""
    if '"' not in address:
        return address  # nearly every address: one C-speed scan on the RCPT hot path
    local, at, domain = address.rpartition("@")
    return f"{canonical_local(local)}@{domain}" if at else address
