"""Parametrized cases split between the two lanes: every combination runs in `make test`, and a
few that between them take every value of every axis also run in `make test-fast` (the others
are marked slow). For grids of Triton-interpreter runs, where each case costs 0.1-0.3 s on CPU."""
from __future__ import annotations

import itertools

import pytest


def _id(value) -> str:
    return str(value).removeprefix("torch.")


def split_grid(axes: list[list], fast: set[tuple]) -> list:
    """Every combination of the axes' values (itertools.product order) as a pytest.param; those
    not in `fast` marked slow. `fast` must take every value of every axis."""
    for i, values in enumerate(axes):
        missing = set(values) - {case[i] for case in fast}
        assert not missing, f"the fast cases leave out axis {i}'s {missing}"
    return [pytest.param(*case, id="-".join(map(_id, case)),
                         marks=() if case in fast else pytest.mark.slow)
            for case in itertools.product(*axes)]
