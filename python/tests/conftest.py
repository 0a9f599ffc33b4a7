"""Shared fixtures. The tests run on the host backend without a GPU (CI) and on the CUDA
backend with one; nothing here needs a CUDA tensor."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator

import pytest

# Keep the host backend small and the same everywhere. It is read when device 0's pager is
# created, i.e. before any test touches it; a GPU ignores it.
os.environ.setdefault("GPU_PAGER_HOST_CAPACITY", "1G")

import gpu_pager  # noqa: E402

_names = itertools.count()


@pytest.fixture(scope="session")
def pager() -> gpu_pager.Pager:
    """The process's pager for device 0."""
    return gpu_pager.Pager.for_device(0)


@pytest.fixture
def new_tag(pager: gpu_pager.Pager) -> Iterator[Callable[[], str]]:
    """Makes fresh tags (the pager outlives the tests); their regions go afterwards."""
    made: list[str] = []

    def make() -> str:
        made.append(f"t{next(_names)}")
        return made[-1]

    yield make
    for t in made:
        if t in pager.tags():
            pager.remove(t)


@pytest.fixture
def tag(new_tag: Callable[[], str]) -> str:
    """One fresh tag."""
    return new_tag()
