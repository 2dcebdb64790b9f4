"""The test summary's note of the tests left out by marker: "5 slow tests not run (pytest -m slow runs them)".

Imported by conftest.py (its hooks are conftest's). Under pytest-xdist the workers collect and deselect, so each
worker hands its counts to the controller through `workeroutput`, and the controller prints them."""

from __future__ import annotations

import pytest

# marker -> how to run the tests it marks
LEFT_OUT_MARKERS = {"slow": "pytest -m slow runs them", "gpu": "pytest -m gpu runs them on a CUDA GPU"}
_KEY = pytest.StashKey[dict]()


def _counts(config: pytest.Config) -> dict[str, int]:
    return config.stash.setdefault(_KEY, {})


def pytest_deselected(items) -> None:
    if not items:
        return
    counts = _counts(items[0].config)
    for marker in LEFT_OUT_MARKERS:
        counts[marker] = counts.get(marker, 0) + sum(1 for item in items if item.get_closest_marker(marker))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the counts to the controller
        session.config.workeroutput["not_run_by_marker"] = dict(_counts(session.config))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    counts = getattr(node, "workeroutput", {}).get("not_run_by_marker", {})
    mine = _counts(node.config)
    for marker, count in counts.items():  # every worker collects all the tests: the same counts
        mine[marker] = max(mine.get(marker, 0), count)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    for marker, how in LEFT_OUT_MARKERS.items():
        if count := _counts(config).get(marker, 0):
            terminalreporter.write_line(f"{count} {marker} test{'s' if count != 1 else ''} not run ({how})")
