import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def tiny_flexidepth(tmp_path_factory):
    from vskipper.checkpoint import make_tiny_model

    return make_tiny_model("flexidepth-llama", tmp_path_factory.mktemp("ckpt") / "flexidepth")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    from vskipper.checkpoint import make_tiny_model

    return make_tiny_model("qwen3-skipper", tmp_path_factory.mktemp("ckpt") / "qwen3")


@pytest.fixture
def cli_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env
