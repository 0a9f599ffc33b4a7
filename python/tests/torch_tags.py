"""Tag fixtures for the tests that put torch tensors in regions: they override
conftest's ``new_tag`` and ``tag`` (import them into the test module)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest


_torch_names = itertools.count()


@pytest.fixture
def new_tag() -> Callable[[], str]:
    """Fresh tags whose regions are never removed: torch keeps their segments in its
    caching allocator, and a region removed under torch would free addresses that torch
    still indexes its blocks by (a later region could get them)."""
    return lambda: f"torch{next(_torch_names)}"


@pytest.fixture
def tag(new_tag: Callable[[], str]) -> str:
    """One fresh tag (never removed)."""
    return new_tag()
