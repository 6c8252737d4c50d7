"""Fixtures shared by the analytics tests: ``spark``, one real local Spark session per
module that asks for it (``test_job`` owns its definition; a module may define its own)."""

from tests.analytics.test_job import spark  # noqa: F401  (a module-scoped fixture)
