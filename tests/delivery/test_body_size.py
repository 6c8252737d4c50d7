"""A body that does not add up to its stored size is never sent with the final dot."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.delivery.transport.data import BodySizeMismatch, exact_size


def drain(chunks: list[bytes], size: int) -> list[bytes]:
    async def run() -> list[bytes]:
        return [chunk async for chunk in exact_size(chunks, size)]

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("chunks", "size", "whole"),
    [
        ([b"abc", b"def"], 6, True),
        ([], 0, True),
        ([b""], 0, True),
        ([b"abc", b"de"], 6, False),  # a torn last chunk
        ([b"abc"], 6, False),  # a lost chunk
        ([b"abc", b"defg"], 6, False),  # more than stored: never the excess
        ([], 1, False),
    ],
)
def test_a_body_passes_only_when_it_adds_up(chunks: list[bytes], size: int, whole: bool) -> None:
    if whole:
        assert drain(chunks, size) == chunks
    else:
        with pytest.raises(BodySizeMismatch):
            drain(chunks, size)


@given(st.lists(st.binary(max_size=50), max_size=8), st.integers(min_value=-5, max_value=5))
def test_the_error_comes_before_the_end_exactly_when_the_sizes_differ(
    chunks: list[bytes], off: int
) -> None:
    size = max(0, sum(map(len, chunks)) + off)
    got: list[bytes] = []

    async def run() -> None:
        stream: AsyncGenerator[bytes, None] = exact_size(chunks, size)
        async for chunk in stream:
            got.append(chunk)

    if size == sum(map(len, chunks)):
        asyncio.run(run())
        assert got == chunks
    else:
        with pytest.raises(BodySizeMismatch):
            asyncio.run(run())
        assert sum(map(len, got)) <= size  # nothing past the size was passed on
