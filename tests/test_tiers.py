"""The suite's own rules (`tests/tiers.py`), run on small suites written here: a test without exactly
one tier marker fails collection by name, a unit test that starts a process fails, a gpu test skips
with one reason where its devices are missing, and a run that leaves a file behind fails naming it."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests import tiers


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytest run of its own, with the rules as its only conftest and its own mark on processes."""
    monkeypatch.setenv(tiers.RUN_MARK, "inner-run")
    monkeypatch.delenv(tiers.AUDIT, raising=False)
    monkeypatch.setattr(tiers, "SETTLE_SECONDS", 0.2)
    # the inner run gives itself a temporary folder (TMPDIR, tempfile's): ours come back afterwards
    monkeypatch.setenv("TMPDIR", tempfile.gettempdir())
    monkeypatch.setattr(tempfile, "tempdir", tempfile.gettempdir())
    return pytester


def run_folders() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("anytime-tests-*"))


@pytest.mark.unit
def test_a_test_without_exactly_one_tier_fails_collection_by_name(inner):
    inner.makepyfile(test_sample="""
        import pytest

        def test_untiered():
            pass

        @pytest.mark.unit
        @pytest.mark.e2e
        def test_two_tiers():
            pass

        @pytest.mark.integration
        def test_one_tier():
            pass
    """)
    result = inner.runpytest_inprocess("-p", "tests.tiers")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*every test needs exactly one tier marker:",
                                 "*test_sample.py::test_untiered: tier markers none; mark it with exactly one of*",
                                 "*test_sample.py::test_two_tiers: tier markers e2e, unit;*"])
    assert "test_one_tier" not in result.stderr.str()


@pytest.mark.unit
def test_a_module_mark_counts_as_the_tier_of_each_test(inner):
    inner.makepyfile(test_sample="""
        import pytest

        pytestmark = pytest.mark.unit

        def test_plain():
            pass
    """)
    assert inner.runpytest_inprocess("-p", "tests.tiers").ret == pytest.ExitCode.OK


GPU_SAMPLE = """
    import pytest

    pytestmark = pytest.mark.gpu

    def test_one_gpu():
        pass

    @pytest.mark.gpus(2)
    @pytest.mark.skipif(True, reason="a reason of its own")
    def test_two_gpus():
        pass
"""


@pytest.mark.unit
@pytest.mark.parametrize("devices, one, two", [(0, "needs CUDA", "needs CUDA"), (1, None, "needs 2 GPUs"),
                                               (2, None, "a reason of its own")])
def test_gpu_tests_skip_with_one_reason_where_their_devices_are_missing(inner, monkeypatch, devices, one, two):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    inner.makepyfile(test_sample=GPU_SAMPLE)
    result = inner.runpytest_inprocess("-p", "tests.tiers", "-m", "gpu")
    assert result.ret == pytest.ExitCode.OK
    reasons = {r.nodeid.split("::")[-1]: r.longrepr[2].removeprefix("Skipped: ")
               for r in result.reprec.getreports("pytest_runtest_logreport") if r.skipped}
    expected = {"test_one_gpu": one, "test_two_gpus": two}
    assert reasons == {test: reason for test, reason in expected.items() if reason is not None}


@pytest.mark.integration   # it starts a process itself, inside the inner run
@pytest.mark.parametrize("where", ["test", "fixture"])
def test_a_unit_test_that_starts_a_process_fails(inner, where):
    inner.makepyfile(test_sample=f"""
        import subprocess, sys
        import pytest

        @pytest.fixture
        def process():
            if {where == "fixture"!r}:
                subprocess.run([sys.executable, "-c", "pass"], check=True)

        @pytest.mark.unit
        def test_starts_one(process):
            if {where == "test"!r}:
                subprocess.run([sys.executable, "-c", "pass"], check=True)
    """)
    result = inner.runpytest_inprocess("-p", "tests.tiers")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*test_starts_one is marked unit but started a child process*mark it integration*"])


@pytest.mark.unit
def test_a_run_that_leaves_a_file_behind_fails_naming_it(inner):
    inner.makepyfile(test_sample="""
        import os, tempfile
        import pytest

        @pytest.mark.unit
        def test_leaves_a_file():
            os.close(tempfile.mkstemp(prefix="left-behind-")[0])
    """)
    folders = run_folders()
    result = inner.runpytest_inprocess("-p", "tests.tiers")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*the test run left these behind*", "*/anytime-tests-*/left-behind-*"])
    assert run_folders() == folders   # the run's own folder went, its leftovers with it


@pytest.mark.integration   # it starts a process of another program
def test_what_another_program_writes_meanwhile_is_not_the_runs_leak(inner):
    """Files another program writes to the machine's temporary folder, and a /dev/shm entry of a live
    process that is not the run's, leave a clean run clean."""
    import os
    import subprocess
    import sys

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={k: v for k, v in os.environ.items() if k != tiers.RUN_MARK})
    in_temp = Path(tempfile.gettempdir()) / f"another-program-{other.pid}"
    in_shm = Path("/dev/shm") / f"anytime-weights-{other.pid}-x.safetensors"
    inner.makepyfile(test_sample=f"""
        import pytest

        @pytest.mark.unit
        def test_another_program_writes():   # as if the other program wrote them while the run ran
            for path in ({str(in_temp)!r}, {str(in_shm)!r}):
                open(path, "w").close()
    """)
    try:
        result = inner.runpytest_inprocess("-p", "tests.tiers")
        assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
        assert in_temp.exists() and in_shm.exists()
    finally:
        other.kill()
        other.wait()
        for path in (in_temp, in_shm):
            path.unlink(missing_ok=True)
