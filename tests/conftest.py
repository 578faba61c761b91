import os
import sys
from pathlib import Path

import pytest

# The Triton kernels are tested on the interpreter (tests run on CPU). Triton reads this when it is first
# imported, and torch may import it early (e.g. via its flop counter), so it is set before any test module loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_collection_modifyitems(config, items):
    """Modules that start real servers (`server` mark) run first, in collection order, the rest after: with
    `make test`'s two workers the long modules start early instead of leaving one worker busy at the end."""
    heavy = {item.module.__name__ for item in items if item.get_closest_marker("server") is not None}
    items.sort(key=lambda item: item.module.__name__ not in heavy)  # stable: order within each group is kept


@pytest.fixture(scope="session")
def tiny_flexidepth(tmp_path_factory):
    from vskipper.checkpoint import make_tiny_model

    return make_tiny_model("flexidepth-llama", tmp_path_factory.mktemp("ckpt") / "flexidepth")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    from vskipper.checkpoint import make_tiny_model

    return make_tiny_model("qwen3-skipper", tmp_path_factory.mktemp("ckpt") / "qwen3")


@pytest.fixture(scope="session")
def served_flexidepth(tmp_path_factory):
    """The tiny FlexiDepth checkpoint with its tokenizer: what the shared servers serve."""
    from tests.sglang_world import servable_tiny_model

    return servable_tiny_model(tmp_path_factory.mktemp("served") / "flexidepth")


@pytest.fixture(scope="session")
def shared_servers(served_flexidepth, tmp_path_factory):
    """The real SGLang servers several modules share (`tests.sglang_world.SHARED`): each starts on first use
    and stops when the session ends."""
    pytest.importorskip("sglang")
    from contextlib import ExitStack

    from tests.sglang_world import SharedServers

    with ExitStack() as stack:
        yield SharedServers(served_flexidepth, tmp_path_factory.mktemp("shared-servers"), stack)


@pytest.fixture
def cli_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A Kubernetes API on loopback (tests/kube_world.py) that the operator under test logs in to."""
    from kube_world import Cluster

    with Cluster() as c:
        monkeypatch.setenv("KUBECONFIG", str(c.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield c
