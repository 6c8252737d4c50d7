"""The shipped reply rules: what the big mailbox providers' reply texts mean.

Tried after an operator's own ``[[reply_rules.rules]]`` (and left out with ``[reply_rules]
defaults = false``).  Each rule cites where its text is published; the patterns are written
for the words that carry the meaning, not whole sentences, since providers re-word and
re-wrap their texts (and put the client's address and a server name in them).

Categories, for events and analytics:

* ``rate_limited``: too much mail, too fast, from our address or domain;
* ``concurrency``: too many connections at once;
* ``complaints``: deferred over the recipients' complaints (a reputation signal);
* ``blocklisted``: our address is on a DNS block list (Spamhaus and the like);
* ``reputation``: the provider itself refuses our address;
* ``recipient_rate``: one recipient gets too much mail (not our fault, not a slow down);
* ``spam``: this message was judged unsolicited.
"""

from __future__ import annotations

from typing import Final

from zoneq.protocol.reply_rules import ReplyAction, ReplyRule

__all__ = ["PROVIDER_RULES"]

_SLOW = ReplyAction.SLOW_DOWN
_BLOCKED = ReplyAction.BLOCKED

# The block-list words also name lists that say nothing about our sending address, where
# resting it and deferring would only turn a bounce into days of retries.  Rules see the
# one-line form ("550 5.1.1 text"), so the start of a pattern can read the status:
# * an X.1.x status is about an address, X.6.x about the content (RFC 3463 sections 3.2
#   and 3.7): Domino's "550 5.1.1 User not listed in public Name & Address Book", "554
#   5.6.0 attachment type on our block list";
# * lists of what a message holds (SURBL, URIBL and Spamhaus's DBL list domains found in
#   bodies; "URL listed"; attachment block lists), whichever status comes with them.
_SENDER_LISTED: Final = (
    r"^(?![0-9]{3} [45]\.[16]\.)"
    r"(?!.*(?:\b(?:SURBL|URIBL|DBL)\b|\bUR[LI]s? (?:is |are )?listed|\battachment))"
)

PROVIDER_RULES: Final[tuple[ReplyRule, ...]] = (
    # --- Gmail: Google Workspace Admin Help, "SMTP error reference" (answer 3726730) -----
    # "421, 4.7.28 Gmail has detected an unusual rate of unsolicited mail originating from
    # your IP address. To protect our users from spam, mail sent from your IP address has
    # been temporarily rate limited."  (Also "... from your DKIM domain" / "SPF domain".)
    ReplyRule.make(r"unusual rate|rate limited", _SLOW, "rate_limited", enhanced="4.7.28"),
    # "450, 4.2.1 The user you are trying to contact is receiving mail at a rate that
    # prevents additional messages from being delivered."  One mailbox, not us: plain defer.
    ReplyRule.make(
        r"receiving mail at a rate",
        ReplyAction.DEFER,
        "recipient_rate",
        enhanced="4.2.1",
    ),
    # "550, 5.7.1 Our system has detected that this message is likely unsolicited mail."
    ReplyRule.make(r"likely unsolicited mail", ReplyAction.BOUNCE, "spam", code="5xx"),
    # "550, 5.7.1 The IP you're using to send mail is not authorized to send email directly
    # to our servers."  (Dynamic or listed address space: another address may be allowed.)
    ReplyRule.make(r"not authorized to send email directly", _BLOCKED, "reputation"),
    # --- Yahoo / AOL: Yahoo Sender Hub, "SMTP error codes" (postmaster.yahooinc.com) ------
    # "421 4.7.0 [TSS04] Messages from 192.0.2.1 temporarily deferred due to unexpected
    # volume or user complaints - 4.16.55.1"; TSS01 is the same for volume alone.
    ReplyRule.make(r"\[TSS0?4\]|user complaints", _SLOW, "complaints", code="4xx"),
    ReplyRule.make(r"\[TSS0?1\]|temporarily deferred due to", _SLOW, "rate_limited", code="4xx"),
    # "421 4.7.0 [TSS09] All messages from 192.0.2.1 will be permanently deferred; Retrying
    # will NOT succeed."  From that address; another one may fare better.
    ReplyRule.make(r"\[TSS0?9\]", _BLOCKED, "reputation"),
    # "553 5.7.1 [BL21] Connections will not be accepted from 192.0.2.1, because the ip is
    # in Spamhaus's list"; BL22/BL23 name other lists.
    ReplyRule.make(r"\[BL2[0-9]\]", _BLOCKED, "blocklisted"),
    # --- Microsoft (Outlook.com, Exchange Online) ------------------------------------------
    # Outlook.com postmaster, "SMTP error codes": "421 RP-001 (...) Unfortunately, some
    # messages from 192.0.2.1 weren't sent. Please try again. We have limits for how many
    # messages can be sent per hour and per day."  RP-002 and RP-003 likewise.
    ReplyRule.make(r"\bRP-00[1-9]\b|limits for how many messages", _SLOW, "rate_limited"),
    # Exchange Online NDR reference: "451 4.7.500-699 (ASxxx) ... Server busy, please try
    # again later" — throttling of a new or suspicious sending address.  Only Microsoft's
    # own markers: "try again later" alone is every greylister's text (rspamd's and
    # Postfix policy servers' "451 4.7.1 Try again later"), which wants a plain retry
    # (RFC 5321 section 4.2.1, 4yz), not a slower domain.
    ReplyRule.make(
        r"server busy|\(AS[0-9]+\)|^4[0-9]{2} 4\.7\.[56][0-9]{2}\b",
        _SLOW,
        "rate_limited",
        enhanced="4.7",
    ),
    # "550 5.7.1 Unfortunately, messages from [192.0.2.1] weren't sent. Please contact your
    # Internet service provider since part of their network is on our block list (S3150)."
    # "550 5.7.708 Service unavailable. Access denied, traffic not accepted from this IP."
    # "550 SC-001 ... messages from 192.0.2.1 weren't sent"; DY-001 for dynamic addresses.
    ReplyRule.make(r"traffic not accepted from this ip", _BLOCKED, "reputation"),
    ReplyRule.make(r"\b(?:SC|DY)-00[1-9]\b|\(S3140\)", _BLOCKED, "reputation"),
    # --- Block lists, whoever runs the receiving server ------------------------------------
    # Postfix's default_rbl_reply (postconf(5)): "554 5.7.1 Service unavailable; Client host
    # [192.0.2.1] blocked using zen.spamhaus.org"; others say "listed at/in/on <list>",
    # "on our block list" (Microsoft, above), "blacklisted"; Comcast's "found on one or more
    # DNSBLs", the CBL's cbl.abuseat.org, Proofpoint's "see https://ipcheck.proofpoint.com".
    # Only a list of sending addresses is our address's problem; see _SENDER_LISTED for
    # what is left out.
    ReplyRule.make(
        _SENDER_LISTED
        + r".*?(?:blocked using|spamhaus|(?<!not )(?<!n't )\blisted (?:at|in|on|by)\b"
        r"|block ?list|black ?list|\bRBL\b|\bDNSBLs?\b|\babuseat\.org\b|ipcheck\.proofpoint)",
        _BLOCKED,
        "blocklisted",
    ),
    # --- Too many connections: Postfix anvil ("421 4.7.0 mx.example.net Error: too many
    # connections from 192.0.2.1"), Exim ("421 Too many concurrent SMTP connections from
    # this IP address; please try again later"), and the many rate limiters that say so.
    ReplyRule.make(r"too many (?:concurrent )?(?:smtp )?connections", _SLOW, "concurrency"),
    ReplyRule.make(
        r"rate limit|too many messages|throttl|sending (?:rate|too fast)",
        _SLOW,
        "rate_limited",
        code="4xx",
    ),
)
