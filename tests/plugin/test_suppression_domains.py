"""The bundled suppression list compares a U-label domain and its A-label as one."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.plugins import BUNDLED


def suppression_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("suppression_idna", BUNDLED / "suppression.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("address", "stored"),
    [
        ("Bob@Bücher.Example", "bob@xn--bcher-kva.example"),
        ("bob@XN--BCHER-KVA.example", "bob@xn--bcher-kva.example"),
        ("Bob@Example.ORG", "bob@example.org"),
        ("postmaster", "postmaster"),
        ("bob@☃.example", "bob@☃.example"),  # IDNA refuses it: kept, lower-cased
    ],
)
def test_normalize(address: str, stored: str) -> None:
    assert suppression_module().normalize(address) == stored


def test_a_list_naming_one_form_suppresses_the_other(tmp_path: Path) -> None:
    plugin = suppression_module()
    path = tmp_path / "suppressed.json"
    path.write_text('{"*": ["bob@bücher.example"], "bulk": ["ann@xn--bcher-kva.example"]}')
    lists = plugin.SuppressionList(path)
    assert lists.suppressed("default", "bob@xn--bcher-kva.example")
    assert lists.suppressed("bulk", "ann@BÜCHER.example")
    assert not lists.suppressed("default", "ann@bücher.example")
