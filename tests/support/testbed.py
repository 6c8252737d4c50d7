"""Whether a missing test-bed program skips a test or fails it.

``tools/dev test`` installs the test bed and exports ``ZONEQ_TESTBED``; under it (and so in
CI) a missing program is a broken set-up and must fail, never turn real-part tests into
skips that look green.  Run by hand without it, such tests skip and say what is missing.
"""

import os

import pytest


def missing(what: str) -> None:
    """Skip, or fail when the test bed was supposed to be installed."""
    if os.environ.get("ZONEQ_TESTBED"):
        pytest.fail(f"test bed incomplete: {what}", pytrace=False)
    pytest.skip(what)
