"""The queue tests run on real stores: reuse the storage tests' fixtures and helpers."""

from tests.storage.conftest import store, stores

__all__ = ["store", "stores"]
