import os

import pytest

# Without a GPU, Triton kernels run in the interpreter (slow: tests keep their shapes small).
# Set before anything imports triton.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# LOPD_NO_SKIP=1 turns every skip into a failure that shows the skip's reason. CI sets it where
# it has installed an optional dependency on purpose (verl, vLLM: .ci/run), so a test there that
# skips, e.g. because the package no longer imports, fails the run instead of passing unseen.
NO_SKIP = os.environ.get("LOPD_NO_SKIP") == "1"


def _fail_if_skipped(report) -> None:
    if NO_SKIP and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped, but LOPD_NO_SKIP=1 forbids it: {report.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_if_skipped(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_if_skipped(outcome.get_result())
