import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models: OpenMP thread barriers cost more than they save, badly so on a shared 2-core box.
os.environ.setdefault("OMP_NUM_THREADS", "1")

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# On a CPU machine the only torch.compile on the suite's paths is vLLM's sampler helper that counts the
# ranks of sampled tokens (`batched_count_greater_than`, integers eager computes alike): compiling it cost
# ~7 s in every vLLM engine process here. The real-model tests (tests/models) keep it, as users run it;
# on a GPU machine nothing changes (vLLM compiles its models there).
if not torch.cuda.is_available():
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
REPO = Path(__file__).resolve().parents[1]
# The suite's rules: one tier marker per test, unit tests start no process, nothing left behind.
pytest_plugins = ["tests.tiers"]


def pytest_configure(config: pytest.Config) -> None:
    """Ray keeps every session's logs and sockets under its temporary folder by design: the suite's
    Ray sessions (its fixture's and those `anytime train` starts) get a folder of the run's own,
    removed when the run ends. xdist workers inherit it."""
    # pytest-xdist hands out whole files (--dist loadfile) in the order `pytest_collection_modifyitems`
    # gives them, not reordered by how many tests each holds (its default puts the few long end-to-end
    # tests last, where one worker ran them alone)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if not hasattr(config, "workerinput") and "RAY_TMPDIR" not in os.environ:
        import tempfile

        os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="anytime-tests-ray-")   # short: Ray's socket paths
        config.stash[_RAY_TMPDIR] = os.environ["RAY_TMPDIR"]


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Before the leftover check (tests/tiers.py runs last): the run's Ray folder goes."""
    folder = session.config.stash.get(_RAY_TMPDIR, None)
    if folder is not None:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with end-to-end tests first, then integration, then unit, each file kept whole (its
    module fixtures are built once): with pytest-xdist the longest tests start first and the short
    ones fill the gaps at the end, instead of one worker finishing a long test alone."""
    rank = {"e2e": 0, "integration": 1, "unit": 2}
    heaviest: dict[str, int] = {}
    for item in items:
        tier = min((rank[m.name] for m in item.iter_markers() if m.name in rank), default=2)
        heaviest[item.fspath.strpath] = min(heaviest.get(item.fspath.strpath, 2), tier)
    items.sort(key=lambda item: heaviest[item.fspath.strpath])


_RAY_TMPDIR = pytest.StashKey[str]()


FIXTURE_MATH_DATA = REPO / "tests" / "fixtures" / "math"


@pytest.fixture(scope="session")
def math_data_dir() -> Path:
    """Benchmark files in the DeepScaleR layout: the small fixtures shipped in tests/fixtures/math,
    or the full sets when ANYTIME_MATH_DATA points at a folder of them."""
    env = os.environ.get("ANYTIME_MATH_DATA")
    path = Path(env) if env else FIXTURE_MATH_DATA
    if not path.is_dir():
        pytest.fail(f"ANYTIME_MATH_DATA={env!r} is not a folder; unset it to use the shipped fixtures")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    """A tiny Qwen2 (head_dim 64) with a tokenizer trained on the synthetic task's text (built once,
    kept in the test cache; tests must not write into it)."""
    from tests.helpers import cached_tiny_model

    return str(cached_tiny_model("tiny", corpus_size=400, seed=0))


@pytest.fixture(scope="session")
def ray_address():
    """One local Ray for the whole session; `anytime train` subprocesses join it through RAY_ADDRESS."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        pytest.skip("needs the ray extra: pip install -e '.[ray]'")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
