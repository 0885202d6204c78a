"""A pytest plugin for gpu_acceptance.py's kernels section: ``-p _pytest_outcomes
--outcomes-json PATH`` writes every test's outcome and whether it is ``gpu``-marked, so one
pytest process (one CUDA initialisation) serves all the kernel test files and the section
can tell the gpu-marked cases that ran from those that skipped, without a second pytest
start to collect them."""

from __future__ import annotations

import json


def pytest_addoption(parser):
    parser.addoption("--outcomes-json", default=None, help="write {nodeid: {outcome, gpu, file}} here")


class _Outcomes:
    def __init__(self, path: str):
        self.path, self.tests = path, {}

    def pytest_collection_finish(self, session):
        for item in session.items:  # the selected ones
            self.tests[item.nodeid] = {"outcome": None, "gpu": item.get_closest_marker("gpu") is not None,
                                       "file": str(item.path.resolve())}

    def pytest_runtest_logreport(self, report):
        # A test's outcome is its call's, or its setup's when that did not pass (a skip
        # mark skips in setup); a failing setup or teardown makes it an error.
        entry = self.tests.get(report.nodeid)
        if entry is None:
            return
        if report.failed and report.when != "call":
            entry["outcome"] = "error"
        elif report.when == "call" or (report.when == "setup" and report.skipped):
            entry["outcome"] = report.outcome

    def pytest_sessionfinish(self, session):
        with open(self.path, "w") as f:
            json.dump(self.tests, f)


def pytest_configure(config):
    path = config.getoption("outcomes_json")
    if path:
        config.pluginmanager.register(_Outcomes(path), "outcomes_json")
