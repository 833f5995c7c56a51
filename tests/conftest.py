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
REPO = Path(__file__).resolve().parents[1]
# The suite's rules: one tier marker per test, unit tests start no process, nothing left behind.
pytest_plugins = ["tests.tiers"]


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
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 (head_dim 64) with a tokenizer trained on the synthetic task's text."""
    from anytime.tasks import synthetic
    from anytime.tasks.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_model"), synthetic.corpus(400), seed=0))


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
