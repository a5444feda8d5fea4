"""A pytest plugin for the sessions that prove version ranges (``lowest``, ``middle``).

The ``tests-*`` sessions run every case at the locked versions. At the other points of the
declared ranges what can break is the API surface a test touches, which its first case already
reaches; running every parameter combination there again would triple the suite. So::

    pytest -p sample_tests --one-case-per-test            # each test function's first case
    pytest -p sample_tests --one-case-per-test --share 1/3  # ... of a third of the functions
    pytest -p sample_tests --one-case-per-test --every-case  # the last flag undoes both

Tests marked ``lock_only`` (with the reason as the marker's ``reason``) are left out here: the
few whose cost at another version is out of proportion to the surface they prove (AOTInductor
compiling C++ for minutes at torch 2.11); they run in the ``tests-*`` sessions.

``--share K/N`` keeps the test functions whose stable hash (CRC-32 of ``path::function`` from
the package folder on) is
``K`` modulo ``N``: ``lowest`` runs ``0/3`` and ``middle`` ``1/3``, so two thirds of the
functions run at a version point other than the lock (the ``tests-*`` sessions run all of
them there), each once. Deselected items are reported by pytest as usual ("N deselected").
"""

from __future__ import annotations

import zlib

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nxd sampling")
    group.addoption(
        "--one-case-per-test",
        action="store_true",
        help="run only the first collected case of each test function",
    )
    group.addoption(
        "--every-case",
        action="store_true",
        help="run every case (undoes --one-case-per-test and --share given before it)",
    )
    group.addoption(
        "--share",
        default=None,
        metavar="K/N",
        help="run only the test functions whose stable hash is K modulo N",
    )


def _share(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    k, _, n = value.partition("/")
    if not (k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
        raise pytest.UsageError(f"--share {value!r}: expected K/N with 0 <= K < N, e.g. 0/2")
    return int(k), int(n)


def _function_id(item: pytest.Item) -> str:
    """``path::Class::function`` without the parameter id (stable across machines)."""
    return item.nodeid.split("[", 1)[0]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "lock_only(reason): left out of the version-point sessions (see sample_tests)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    lock_only = [item for item in items if item.get_closest_marker("lock_only")]
    if lock_only:
        config.hook.pytest_deselected(items=lock_only)
        items[:] = [item for item in items if not item.get_closest_marker("lock_only")]
    one_case = config.getoption("--one-case-per-test")
    share = _share(config.getoption("--share"))
    if config.getoption("--every-case") or (not one_case and share is None):
        return
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    seen: set[str] = set()
    for item in items:
        function = _function_id(item)
        # The id from the package folder on ("nxd-state/tests/test_x.py::test_y"): the same
        # whether pytest runs in the checkout or, with --rootdir packages/, outside it.
        stable = function.removeprefix("packages/")
        keep = share is None or zlib.crc32(stable.encode()) % share[1] == share[0]
        if one_case:
            keep = keep and function not in seen
            seen.add(function)
        (kept if keep else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
