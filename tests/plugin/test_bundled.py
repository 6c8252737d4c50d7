"""The bundled plugins (plugins/*.py), loaded from the repository as zoneq loads them."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import dkim
import pytest

from tests.support.plugins import BUNDLED, config_with, host_with, sender_args
from zoneq.config import InvalidConfig
from zoneq.errors import ConfigError
from zoneq.plugin import Drop, Hook, PluginHost, RouteArgs
from zoneq.queue.routing import Route, Router

MESSAGE = (
    b"From: Shop <news@shop.example>\r\n"
    b"To: b@dst.test\r\n"
    b"Subject: Hello\r\n"
    b"Date: Sat, 21 Nov 2026 09:00:00 +0000\r\n"
    b"Message-ID: <m1@shop.example>\r\n"
    b"\r\n"
    b"Line one\r\n"
    b".dot line stays as it is here (stuffing is the encoder's job)\r\n"
    b"Last line\r\n"
)


# --- DKIM --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rsa_key(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes]:
    """A fresh 2048-bit key made by openssl: (private key PEM, DNS TXT record value)."""
    directory = tmp_path_factory.mktemp("dkim")
    key = directory / "key.pem"
    subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
    public = subprocess.run(
        ["openssl", "rsa", "-in", str(key), "-pubout", "-outform", "DER"],
        check=True,
        capture_output=True,
    ).stdout
    return key.read_bytes(), b"v=DKIM1; k=rsa; p=" + base64.b64encode(public)


def dkim_host(
    tmp_path: Path, private: bytes, domain: str = "shop.example", **more: object
) -> PluginHost:
    """The DKIM plugin signing for ``domain`` with ``private``; ``more``: other options."""
    key_file = tmp_path / "dkim.pem"
    key_file.write_bytes(private)
    options = {"domains": {domain: {"selector": "s1", "key_file": str(key_file)}}, **more}
    return host_with({"dkim": {"module": BUNDLED / "dkim.py", "options": options}})


def test_dkim_signature_verifies_with_dkimpy(tmp_path: Path, rsa_key: tuple[bytes, bytes]) -> None:
    private, txt = rsa_key
    host = dkim_host(tmp_path, private)
    result = asyncio.run(host.call(Hook.SENDER_HEADERS, sender_args(MESSAGE)))
    assert len(result.headers) == 1 and result.headers[0].startswith(b"DKIM-Signature:")
    signed = result.headers[0] + MESSAGE
    assert b"d=shop.example" in result.headers[0] and b"s=s1" in result.headers[0]
    lookups: list[bytes] = []

    def dns(name: bytes, timeout: int = 5) -> bytes:
        lookups.append(name)
        return txt if name == b"s1._domainkey.shop.example." else b""

    assert dkim.verify(signed, dnsfunc=dns)
    assert lookups == [b"s1._domainkey.shop.example."]
    # The verifier is not a rubber stamp: a changed body fails.
    assert not dkim.verify(signed.replace(b"Line one", b"Line 1"), dnsfunc=dns)


def test_dkim_uses_the_envelope_domain_when_from_has_no_key(
    tmp_path: Path, rsa_key: tuple[bytes, bytes]
) -> None:
    private, _ = rsa_key
    host = dkim_host(tmp_path, private, domain="bounce.example")
    args = sender_args(MESSAGE, sender="bounces+x@bounce.example")
    result = asyncio.run(host.call(Hook.SENDER_HEADERS, args))
    assert b"d=bounce.example" in result.headers[0]
    unsigned = asyncio.run(host.call(Hook.SENDER_HEADERS, sender_args(MESSAGE)))
    assert unsigned.headers == ()  # no key for shop.example nor src.test: sent unsigned


def test_dkim_missing_key_file_stops_start_up(tmp_path: Path) -> None:
    options = {"domains": {"shop.example": {"selector": "s1", "key_file": str(tmp_path / "no")}}}
    with pytest.raises(ConfigError) as info:
        host_with({"dkim": {"module": BUNDLED / "dkim.py", "options": options}})
    assert info.value.key == 'plugins.dkim.options.domains."shop.example".key_file'
    assert "No such file" in info.value.problem


@pytest.mark.parametrize(
    "content",
    [b"", b"not a key\n", "truncated", "public"],
    ids=["empty", "text", "truncated-pem", "public-key"],
)
def test_dkim_key_file_without_a_private_key_stops_start_up(
    tmp_path: Path, rsa_key: tuple[bytes, bytes], content: bytes | str
) -> None:
    """A key file that reads but cannot sign fails at start-up (and in check-config), not
    at every delivery of the domain's mail."""
    private, txt = rsa_key
    if content == "truncated":
        content = private[: len(private) // 2]
    elif content == "public":
        der = base64.b64encode(base64.b64decode(txt.partition(b"p=")[2]))
        content = b"-----BEGIN PUBLIC KEY-----\n" + der + b"\n-----END PUBLIC KEY-----\n"
    assert isinstance(content, bytes)
    key_file = tmp_path / "not-a-key.pem"
    key_file.write_bytes(content)
    options = {"domains": {"Shop.Example": {"selector": "s1", "key_file": str(key_file)}}}
    with pytest.raises(ConfigError) as info:
        host_with({"dkim": {"module": BUNDLED / "dkim.py", "options": options}})
    assert info.value.key == 'plugins.dkim.options.domains."Shop.Example".key_file'
    assert "no usable private key" in info.value.problem and str(key_file) in info.value.problem


def test_dkim_reports_every_bad_key_at_once(tmp_path: Path, rsa_key: tuple[bytes, bytes]) -> None:
    good, bad = tmp_path / "good.pem", tmp_path / "bad.pem"
    good.write_bytes(rsa_key[0])
    bad.write_bytes(b"not a key\n")
    options = {
        "domains": {
            "a.example": {"selector": "s1", "key_file": str(bad)},
            "b.example": {"selector": "s1", "key_file": str(tmp_path / "missing.pem")},
            "c.example": {"selector": "s1", "key_file": str(good)},
        }
    }
    with pytest.raises(InvalidConfig) as info:
        host_with({"dkim": {"module": BUNDLED / "dkim.py", "options": options}})
    keys = {p.key for p in info.value.problems}
    assert keys == {
        'plugins.dkim.options.domains."a.example".key_file',
        'plugins.dkim.options.domains."b.example".key_file',
    }


@pytest.mark.parametrize(
    "key_domain", ["xn--bcher-kva.example", "bücher.example", "BÜCHER.example."]
)
@pytest.mark.parametrize(
    "from_domain", ["xn--bcher-kva.example", "bücher.example", "Bücher.Example"]
)
def test_dkim_matches_idn_domains_in_either_form_and_signs_the_a_label(
    tmp_path: Path, rsa_key: tuple[bytes, bytes], key_domain: str, from_domain: str
) -> None:
    """RFC 8616 section 4: ``d=`` carries the A-labels; a key under either form signs a
    From in either form (both name one domain)."""
    private, txt = rsa_key
    host = dkim_host(tmp_path, private, domain=key_domain)
    message = MESSAGE.replace(b"news@shop.example", f"news@{from_domain}".encode())
    result = asyncio.run(host.call(Hook.SENDER_HEADERS, sender_args(message)))
    assert len(result.headers) == 1
    assert result.headers[0].isascii()
    tags = {t.strip().partition(b"=")[0]: t.strip() for t in result.headers[0].split(b";")}
    assert tags[b"d"] == b"d=xn--bcher-kva.example"

    def dns(name: bytes, timeout: int = 5) -> bytes:
        return txt if name == b"s1._domainkey.xn--bcher-kva.example." else b""

    assert dkim.verify(result.headers[0] + message, dnsfunc=dns)


def test_dkim_bad_option_names_its_key() -> None:
    options = {"domains": {"shop.example": {"selector": "s1", "keyfile": "x"}}}
    with pytest.raises(InvalidConfig) as info:
        config_with({"dkim": {"module": BUNDLED / "dkim.py", "options": options}})
    keys = {p.key for p in info.value.problems}
    assert 'plugins.dkim.options.domains."shop.example".keyfile' in keys
    assert 'plugins.dkim.options.domains."shop.example".key_file' in keys  # missing


# --- suppression ---------------------------------------------------------------------------------


def suppression_router(tmp_path: Path, action: str, listed: dict[str, list[str]]) -> Router:
    path = tmp_path / "suppressed.json"
    path.write_text(json.dumps(listed))
    plugins = {
        "suppression": {
            "module": BUNDLED / "suppression.py",
            "options": {"file": str(path), "action": action},
        }
    }
    rules = {"rules": [{"recipient_domain": ["bulk.test"], "zone": "bulk"}]}
    config = config_with(plugins, routing=rules)
    return Router.from_config(config, PluginHost.from_config(config))


@pytest.mark.parametrize(
    ("recipient", "expected"),
    [
        ("x@bulk.test", "550 5.1.1 Recipient is on the suppression list"),  # listed for bulk
        ("X@Bulk.Test", "550 5.1.1 Recipient is on the suppression list"),  # case-insensitive
        ("x@other.test", "default"),  # listed for bulk only; routed to default
        ("all@other.test", "550 5.1.1 Recipient is on the suppression list"),  # "*"
        ("fine@bulk.test", "bulk"),
    ],
)
def test_suppressed_recipient_is_refused_in_its_zone(
    tmp_path: Path, recipient: str, expected: str
) -> None:
    router = suppression_router(
        tmp_path, "refuse", {"bulk": ["x@bulk.test", "x@other.test"], "*": ["all@other.test"]}
    )
    result = asyncio.run(router.route(recipient, sender="a@src.test"))
    assert (result.zone if isinstance(result, Route) else str(result)) == expected


def test_suppressed_recipient_is_dropped_when_configured(tmp_path: Path) -> None:
    router = suppression_router(tmp_path, "drop", {"bulk": ["x@bulk.test"]})
    result = asyncio.run(router.route("x@bulk.test", sender="a@src.test"))
    assert result == Drop("suppressed in zone bulk", zone="bulk")


def test_suppression_list_is_reread_when_the_file_changes(tmp_path: Path) -> None:
    router = suppression_router(tmp_path, "refuse", {"bulk": []})
    assert isinstance(asyncio.run(router.route("x@bulk.test")), Route)
    path = tmp_path / "suppressed.json"
    new = tmp_path / "new.json"
    new.write_text(json.dumps({"bulk": ["x@bulk.test", "y@bulk.test"]}))
    os.replace(new, path)  # as the file's docstring asks: write, then rename over
    assert not isinstance(asyncio.run(router.route("x@bulk.test")), Route)


def test_suppression_broken_file_stops_start_up(tmp_path: Path) -> None:
    path = tmp_path / "suppressed.json"
    path.write_text('{"bulk": "x@bulk.test"}')
    with pytest.raises(ConfigError) as info:
        host_with({"s": {"module": BUNDLED / "suppression.py", "options": {"file": str(path)}}})
    assert info.value.key == "plugins.s.options.file"
    assert "zone name -> [addresses]" in info.value.problem


# --- rules router ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sender", "recipient", "zone"),
    [
        ("noreply-42@shop.example", "b@dst.test", "tx"),
        ("NoReply-7@Shop.Example", "b@dst.test", "tx"),
        ("news@shop.example", "student@cs.uni.edu", "bulk"),
        ("news@shop.example", "b@dst.test", None),
    ],
)
def test_rules_router_routes_by_address_pattern(
    sender: str, recipient: str, zone: str | None
) -> None:
    options = {
        "rules": [
            {"sender": "noreply-*@shop.example", "zone": "tx"},
            {"recipient": "*@*.edu", "zone": "bulk"},
        ]
    }
    host = host_with({"rr": {"module": BUNDLED / "rules_router.py", "options": options}})
    args = RouteArgs(sender, recipient, "default", "default")
    assert asyncio.run(host.call(Hook.QUEUE_ROUTE, args)).zone == zone


def test_rules_router_refuses_an_undefined_zone_at_start_up() -> None:
    options = {"rules": [{"sender": "*", "zone": "nope"}]}
    with pytest.raises(ConfigError, match="nope"):
        host_with({"rr": {"module": BUNDLED / "rules_router.py", "options": options}})


def test_dkim_over_max_size_goes_out_unsigned_with_a_warning(
    tmp_path: Path, rsa_key: tuple[bytes, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    private, _ = rsa_key
    # Exactly this message fits; one byte more does not.
    host = dkim_host(tmp_path, private, max_size=f"{len(MESSAGE)}B")
    fits = asyncio.run(host.call(Hook.SENDER_HEADERS, sender_args(MESSAGE)))
    assert fits.headers[0].startswith(b"DKIM-Signature:")
    with caplog.at_level("WARNING", logger="zoneq.plugin.dkim"):
        over = asyncio.run(host.call(Hook.SENDER_HEADERS, sender_args(MESSAGE + b"x\r\n")))
    assert over.headers == ()
    [record] = [r for r in caplog.records if r.name == "zoneq.plugin.dkim"]
    assert "m1 to dst.test is over max_size" in record.getMessage()
    assert "without a DKIM signature" in record.getMessage()


def test_dkim_signs_off_the_event_loop_on_the_plugins_threads(
    tmp_path: Path, rsa_key: tuple[bytes, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    private, _ = rsa_key
    host = dkim_host(tmp_path, private)
    seen: list[str] = []
    original = dkim.sign

    def recording(*args: Any, **kwargs: Any) -> bytes:  # the real signer, noting its thread
        seen.append(threading.current_thread().name)
        signature: bytes = original(*args, **kwargs)
        return signature

    monkeypatch.setattr(dkim, "sign", recording)  # the plugin calls dkimpy.sign at run time
    result = asyncio.run(host.call(Hook.SENDER_HEADERS, sender_args(MESSAGE)))
    assert result.headers[0].startswith(b"DKIM-Signature:")
    assert len(seen) == 1 and seen[0].startswith("plugin-dkim-")


@pytest.mark.parametrize(
    "broken",
    [
        MESSAGE.replace(b"Subject: Hello\r\n", b"Subject: Hello\r\nno colon here\r\n"),
        b" a folded line first\r\n" + MESSAGE,  # dkimpy: IndexError, not its own error
    ],
    ids=["no-colon", "folded-first"],
)
def test_dkim_message_dkimpy_cannot_parse_goes_out_unsigned_with_a_warning(
    tmp_path: Path,
    rsa_key: tuple[bytes, bytes],
    caplog: pytest.LogCaptureFixture,
    broken: bytes,
) -> None:
    """A header section dkimpy cannot parse makes it refuse the message; like an oversized
    one it is sent unsigned, not failed (a 451 at every attempt, then a bounce)."""
    private, _ = rsa_key
    host = dkim_host(tmp_path, private)
    with caplog.at_level("WARNING", logger="zoneq.plugin.dkim"):
        result = asyncio.run(host.call(Hook.SENDER_HEADERS, sender_args(broken)))
    assert result.headers == ()
    [record] = [r for r in caplog.records if r.name == "zoneq.plugin.dkim"]
    assert "m1 to dst.test cannot be signed" in record.getMessage()
    assert "without a DKIM signature" in record.getMessage()
    # The same host still signs a well-formed message.
    signed = asyncio.run(host.call(Hook.SENDER_HEADERS, sender_args(MESSAGE)))
    assert signed.headers[0].startswith(b"DKIM-Signature:")


@pytest.mark.parametrize(
    ("headers", "key", "words"),
    [
        (["Subject", "To"], "plugins.dkim.options.headers", "must include From"),
        ([], "plugins.dkim.options.headers", "must include From"),
        (["From", "Bad Name"], "plugins.dkim.options.headers[1]", "not a header field name"),
        (["From", "To:"], "plugins.dkim.options.headers[1]", "not a header field name"),
        (["From", "X;Y"], "plugins.dkim.options.headers[1]", "not a header field name"),
        (["From", ""], "plugins.dkim.options.headers[1]", "not a header field name"),
        (["From", "X-Grüße"], "plugins.dkim.options.headers[1]", "not a header field name"),
    ],
)
def test_dkim_bad_headers_option_names_its_key(headers: list[str], key: str, words: str) -> None:
    """RFC 6376 section 5.4 (From is signed) and RFC 5322 section 3.6.8 (field names),
    reported against ``headers`` rather than as a problem with the key file."""
    options = {"domains": {"shop.example": {"selector": "s1", "key_file": "x"}}, "headers": headers}
    with pytest.raises(InvalidConfig) as info:
        config_with({"dkim": {"module": BUNDLED / "dkim.py", "options": options}})
    problems = {p.key: p.text for p in info.value.problems}
    assert list(problems) == [key]
    assert words in problems[key]


def test_dkim_headers_option_in_any_case_signs_those_fields(
    tmp_path: Path, rsa_key: tuple[bytes, bytes]
) -> None:
    private, _ = rsa_key
    host = dkim_host(tmp_path, private, headers=["from", "Subject"])
    result = asyncio.run(host.call(Hook.SENDER_HEADERS, sender_args(MESSAGE)))
    tags = {t.strip().partition(b"=")[0]: t.strip() for t in result.headers[0].split(b";")}
    assert b"".join(tags[b"h"].split()).lower() == b"h=from:subject"
