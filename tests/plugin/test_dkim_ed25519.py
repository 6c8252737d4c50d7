"""Ed25519 DKIM signatures (RFC 8463) and dual signing, by the bundled plugins/dkim.py.

Keys are made by openssl as an administrator would make them; every signature is checked
by dkimpy's verifier against the public key openssl derives, served through its dnsfunc
argument (no network).
"""

from __future__ import annotations

import asyncio
import base64
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dkim
import pytest

from tests.delivery.inproc import config_for, dns_for, running
from tests.plugin.test_bundled import MESSAGE, dkim_host, rsa_key
from tests.support.plugins import BUNDLED, host_with, sender_args
from tests.support.smtpsink import run_smtp_sink
from zoneq.config import InvalidConfig
from zoneq.errors import ConfigError
from zoneq.plugin import Hook, PluginHost

__all__ = ["rsa_key"]  # the fixture, imported for pytest

# RFC 8410 section 7: PKCS#8 of an Ed25519 key, the 16 bytes before the 32-byte seed.
PKCS8_PREFIX = bytes.fromhex("302e020100300506032b657004220420")


@dataclass(frozen=True)
class Ed25519Key:
    pem: bytes  # as openssl genpkey -algorithm ed25519 writes it
    seed: bytes  # the same key as dkimpy's dknewkey writes it: base64 of the seed
    txt: bytes  # the DNS TXT record (RFC 8463 section 4)


@pytest.fixture(scope="module")
def ed25519_key(tmp_path_factory: pytest.TempPathFactory) -> Ed25519Key:
    key = tmp_path_factory.mktemp("ed25519") / "key.pem"
    subprocess.run(
        ["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(key)],
        check=True,
        capture_output=True,
    )

    def der(*more: str) -> bytes:
        command = ["openssl", "pkey", "-in", str(key), "-outform", "DER", *more]
        return subprocess.run(command, check=True, capture_output=True).stdout

    private, public = der(), der("-pubout")
    assert private.startswith(PKCS8_PREFIX) and len(private) == 48
    return Ed25519Key(
        pem=key.read_bytes(),
        seed=base64.b64encode(private[16:]) + b"\n",
        # The public key is the last 32 bytes of its SubjectPublicKeyInfo (RFC 8410 4).
        txt=b"v=DKIM1; k=ed25519; p=" + base64.b64encode(public[-32:]),
    )


def dns(records: dict[bytes, bytes]) -> Callable[..., bytes]:
    """A dnsfunc for dkimpy: ``records`` by selector, under shop.example."""

    def lookup(name: bytes, timeout: int = 5) -> bytes:
        selector, _, domain = name.partition(b"._domainkey.")
        return records.get(selector, b"") if domain == b"shop.example." else b""

    return lookup


def tags(field: bytes) -> dict[bytes, bytes]:
    """A DKIM-Signature field's tags, whitespace removed: {b"a": b"ed25519-sha256", ...}."""
    value = b"".join(field.partition(b":")[2].split())
    return dict(tag.partition(b"=")[::2] for tag in value.split(b";") if tag)


def verifies(message: bytes, index: int, lookup: Callable[..., bytes]) -> bool:
    """Whether the ``index``-th DKIM-Signature of ``message`` verifies (dkim.verify checks
    the first only), a failure as False as dkim.verify gives it."""
    try:
        return bool(dkim.DKIM(message).verify(idx=index, dnsfunc=lookup))
    except dkim.DKIMException:
        return False


def dkim_keys_host(tmp_path: Path, keys: list[dict[str, Any]] | dict[str, Any]) -> PluginHost:
    """The DKIM plugin with ``keys`` (one table or an array) for shop.example; each key's
    ``content`` is written to a file of its own and given as its key_file."""

    def table(index: int, key: dict[str, Any]) -> dict[str, Any]:
        key_file = tmp_path / f"key{index}"
        key_file.write_bytes(key.pop("content"))
        return {**key, "key_file": str(key_file)}

    tables: Any = (
        [table(i, dict(key)) for i, key in enumerate(keys)]
        if isinstance(keys, list)
        else table(0, dict(keys))
    )
    options = {"domains": {"shop.example": tables}}
    return host_with({"dkim": {"module": BUNDLED / "dkim.py", "options": options}})


def signatures(host: PluginHost, message: bytes = MESSAGE) -> tuple[bytes, ...]:
    result = asyncio.run(host.call(Hook.SENDER_HEADERS, sender_args(message)))
    return result.headers


@pytest.mark.parametrize("form", ["pem", "seed"])
def test_an_ed25519_key_signs_and_dkimpy_verifies(
    tmp_path: Path, ed25519_key: Ed25519Key, form: str
) -> None:
    """The algorithm is read from the key, in either form an administrator would have."""
    private = ed25519_key.pem if form == "pem" else ed25519_key.seed
    (field,) = signatures(dkim_host(tmp_path, private))
    assert tags(field)[b"a"] == b"ed25519-sha256"
    lookup = dns({b"s1": ed25519_key.txt})
    assert dkim.verify(field + MESSAGE, dnsfunc=lookup)
    assert not dkim.verify(field + MESSAGE.replace(b"Line one", b"Line 1"), dnsfunc=lookup)


@pytest.mark.parametrize("algorithm", ["ed25519-sha256", None])
def test_rsa_and_ed25519_keys_each_add_a_signature_that_verifies(
    tmp_path: Path,
    ed25519_key: Ed25519Key,
    rsa_key: tuple[bytes, bytes],
    algorithm: str | None,
) -> None:
    """RFC 8463 section 3: during the transition a domain signs with both algorithms."""
    ed25519 = {"selector": "ed", "content": ed25519_key.pem}
    if algorithm:
        ed25519["algorithm"] = algorithm
    keys = [{"selector": "rsa", "content": rsa_key[0]}, ed25519]
    fields = signatures(dkim_keys_host(tmp_path, keys))
    assert [(tags(f)[b"s"], tags(f)[b"a"]) for f in fields] == [
        (b"rsa", b"rsa-sha256"),
        (b"ed", b"ed25519-sha256"),
    ]
    signed = b"".join(fields) + MESSAGE
    lookup = dns({b"rsa": rsa_key[1], b"ed": ed25519_key.txt})
    assert [verifies(signed, i, lookup) for i in range(2)] == [True, True]
    tampered = signed.replace(b"Line one", b"Line 1")
    assert [verifies(tampered, i, lookup) for i in range(2)] == [False, False]


def test_an_array_of_one_key_signs_once(tmp_path: Path, ed25519_key: Ed25519Key) -> None:
    fields = signatures(dkim_keys_host(tmp_path, [{"selector": "s1", "content": ed25519_key.seed}]))
    assert len(fields) == 1
    assert dkim.verify(fields[0] + MESSAGE, dnsfunc=dns({b"s1": ed25519_key.txt}))


def ed25519_v2(seed: bytes) -> bytes:
    """RFC 5958's OneAsymmetricKey v2 with a (here made-up) public key after the seed."""
    der = bytes.fromhex("3051020101300506032b657004220420") + seed + bytes.fromhex("812100")
    der += bytes(32)
    return (
        b"-----BEGIN PRIVATE KEY-----\n" + base64.b64encode(der) + b"\n-----END PRIVATE KEY-----\n"
    )


@dataclass(frozen=True)
class BadKey:
    holds: str  # which of key_contents() the file holds
    algorithm: str | None  # the option, None when not given
    words: str  # what the problem must say


BAD_KEYS = [
    BadKey("rsa", "ed25519-sha256", 'holds no Ed25519 private key (algorithm = "ed25519-sha256")'),
    BadKey("short-seed", "ed25519-sha256", "holds no Ed25519 private key"),
    BadKey("text", "ed25519-sha256", "as openssl genpkey -algorithm ed25519 writes it"),
    BadKey("pem", "rsa-sha256", 'holds an Ed25519 key, not the RSA key algorithm = "rsa-sha256"'),
    BadKey("v2", None, "Ed25519 key in a PKCS#8 form other than the one openssl genpkey writes"),
    BadKey("text", None, "(read as rsa-sha256); an Ed25519 key would be PEM"),
]


@pytest.fixture
def key_contents(ed25519_key: Ed25519Key, rsa_key: tuple[bytes, bytes]) -> dict[str, bytes]:
    return {
        "rsa": rsa_key[0],
        "short-seed": base64.b64encode(bytes(31)),
        "text": b"not a key\n",
        "pem": ed25519_key.pem,
        "v2": ed25519_v2(bytes(32)),
        "good": ed25519_key.seed,
    }


@pytest.mark.parametrize("bad", BAD_KEYS, ids=lambda bad: f"{bad.holds}-as-{bad.algorithm}")
@pytest.mark.parametrize("as_array", [False, True], ids=["table", "array"])
def test_a_bad_ed25519_key_stops_start_up_naming_its_option(
    tmp_path: Path, key_contents: dict[str, bytes], bad: BadKey, as_array: bool
) -> None:
    """Refused when the plugin loads (zoneq serve and check-config alike), the problem at
    the key's key_file, with the algorithm named; in an array, at the key's own index."""
    table: dict[str, Any] = {"selector": "bad", "content": key_contents[bad.holds]}
    if bad.algorithm:
        table["algorithm"] = bad.algorithm
    good = {"selector": "good", "content": key_contents["good"]}
    with pytest.raises(ConfigError) as info:
        dkim_keys_host(tmp_path, [good, table] if as_array else table)
    where, key_file = ("[1].key_file", "key1") if as_array else (".key_file", "key0")
    assert info.value.key == f'plugins.dkim.options.domains."shop.example"{where}'
    assert bad.words in info.value.problem
    assert str(tmp_path / key_file) in info.value.problem


@pytest.mark.parametrize(
    ("tables", "key", "words"),
    [
        ([], "", "an empty array signs nothing"),
        (
            [{"selector": "s1", "key_file": "a"}, {"selector": "s1", "key_file": "b"}],
            "",
            "a selector of its own",
        ),
        ([{"selector": "s1", "key_file": "a", "algorithm": "ed448"}], "[0].algorithm", "ed25519"),
        ({"selector": "s1", "key_file": "a", "algorithm": "rsa"}, ".algorithm", "rsa-sha256"),
        ([{"selector": "s1"}], "[0].key_file", "required key is missing"),
    ],
)
def test_bad_key_tables_name_their_key(tables: Any, key: str, words: str) -> None:
    options = {"domains": {"shop.example": tables}}
    with pytest.raises(InvalidConfig) as info:
        host_with({"dkim": {"module": BUNDLED / "dkim.py", "options": options}})
    problems = {p.key: p.text for p in info.value.problems}
    assert list(problems) == [f'plugins.dkim.options.domains."shop.example"{key}']
    assert words in problems[f'plugins.dkim.options.domains."shop.example"{key}']


@pytest.mark.integration
def test_both_signatures_go_out_and_verify_at_the_sink(
    tmp_path: Path, ed25519_key: Ed25519Key, rsa_key: tuple[bytes, bytes]
) -> None:
    """Dual signing through the real queue (LevelDB), worker and transport to smtp-sink:
    both fields are in the delivered message, and each verifies there."""
    (tmp_path / "rsa.pem").write_bytes(rsa_key[0])
    (tmp_path / "ed.pem").write_bytes(ed25519_key.pem)
    keys = [
        {"selector": "rsa", "key_file": str(tmp_path / "rsa.pem")},
        {"selector": "ed", "key_file": str(tmp_path / "ed.pem")},
    ]
    dkim_table = {
        "module": str(BUNDLED / "dkim.py"),
        "options": {"domains": {"shop.example": keys}},
    }
    with run_smtp_sink() as sink, dns_for(tmp_path, ["ok.test"], sink.host) as dns_server:
        config = config_for(tmp_path, dns_server, sink.port, plugins={"dkim": dkim_table})

        async def main() -> None:
            async with running(config, worker_plugins=PluginHost.from_config(config)) as core:
                await core.queue(["someone@ok.test"])
                await core.until(lambda: core.store.message_count() == 0)

        asyncio.run(main())
        (received,) = sink.messages(1)
    message = received.content.replace(b"\n", b"\r\n")  # smtp-sink dumps with LF
    assert message.count(b"DKIM-Signature:") == 2
    lookup = dns({b"rsa": rsa_key[1], b"ed": ed25519_key.txt})
    assert [verifies(message, i, lookup) for i in range(2)] == [True, True]


@pytest.mark.parametrize("other", ["Shop.EXAMPLE", "shop.example."])
def test_one_domain_in_two_spellings_is_refused(
    tmp_path: Path, rsa_key: tuple[bytes, bytes], other: str
) -> None:
    """Pooled, the two entries' keys went unchecked for a repeated selector: a message
    carried a signature whose s= named another key's record, failing every verification."""
    key_file = tmp_path / "rsa.pem"
    key_file.write_bytes(rsa_key[0])
    entry = {"selector": "s1", "key_file": str(key_file)}
    options = {"domains": {"shop.example": entry, other: entry}}
    with pytest.raises(ConfigError) as info:
        host_with({"dkim": {"module": BUNDLED / "dkim.py", "options": options}})
    assert info.value.key == f'plugins.dkim.options.domains."{other}"'
    assert "'shop.example'" in info.value.problem and "one entry" in info.value.problem
