"""Options for the whole suite.

``--long`` runs the fault tests (``tests/reliability/``, and the receiver's crash test) with
more iterations.  It is the same switch as the environment variable ``ZONEQ_LONG_TESTS=1``,
which it sets: the tests read that one place.  It is registered here, at the root of the
tests, because pytest takes ``pytest_addoption`` only from conftest files it loads before
collecting, which a conftest deeper down is not when the whole suite is run.
"""

from __future__ import annotations

import os

import pytest

LONG_ENV = "ZONEQ_LONG_TESTS"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help=f"run the fault tests with more iterations (the same as {LONG_ENV}=1)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--long"):
        os.environ[LONG_ENV] = "1"


def long_tests() -> bool:
    """Whether the long profile was asked for (``--long`` or the environment variable)."""
    return os.environ.get(LONG_ENV) == "1"
