"""`vskipper.mixed.host_waits`: each wait recorded at the nearest frame of vSkipper's code or of an engine's, and the
GPU's watch (torch's CUDA sync debug mode) recording every synchronizing call with its site. No CUDA runtime runs
here: the watch's mode switch is faked, and its warning is issued as torch issues it (a warning attributed to the
Python frame that called the operator); what runs is the watch's own handling of it."""

import os
import traceback
import warnings

import pytest
import torch

import vskipper
from vskipper.mixed import host_waits
from vskipper.mixed.host_waits import SYNC_MESSAGE, DeviceSyncWatch, HostWaitDetector, site

PACKAGE = os.path.dirname(vskipper.__file__)


def frame(path: str, line: int = 7, name: str = "f") -> traceback.FrameSummary:
    return traceback.FrameSummary(path, line, name, lookup_line=False)


def test_a_wait_is_placed_at_the_nearest_frame_of_vskipper_or_of_the_engine():
    import sglang

    engine = os.path.join(os.path.dirname(sglang.__file__), "srt", "layers", "attention", "triton_backend.py")
    torch_frame = os.path.join(os.path.dirname(torch.__file__), "_tensor.py")
    routed = os.path.join(PACKAGE, "mixed", "routed_layer.py")
    glue = os.path.join(PACKAGE, "sglang", "models", "routed.py")  # vSkipper's own package named like the engine
    # innermost last: torch's frame is neither, the backend's is nearer than the layer that called it
    assert site([frame(routed, 40, "mixed_depth"), frame(engine, 9, "forward_extend"), frame(torch_frame)]) == (
        "sglang/srt/layers/attention/triton_backend.py:9 in forward_extend", False)
    assert site([frame(engine), frame(routed, 40, "mixed_depth"), frame(torch_frame)]) == (
        "vskipper/mixed/routed_layer.py:40 in mixed_depth", True)
    assert site([frame(engine), frame(glue, 3, "forward")]) == ("vskipper/sglang/models/routed.py:3 in forward", True)
    # in neither: the code that called torch; a folder named like the engine is not the engine's package
    assert site([frame("/opt/sglang/bench.py", 5, "main"), frame(torch_frame, 2, "item")]) == (
        "/opt/sglang/bench.py:5 in main", False)
    assert site([frame("/x/bench.py", 5, "main"), frame(torch_frame, 2, "item")]) == ("/x/bench.py:5 in main", False)


def test_the_cpu_detector_records_each_wait_with_its_site():
    source = compile("def sized(t):\n    return int(t.sum())\n", os.path.join(PACKAGE, "mixed", "sized.py"), "exec")
    scope = {}
    exec(source, scope)
    with HostWaitDetector() as detector:
        scope["sized"](torch.ones(3))
        torch.ones(3).nonzero()
    assert detector.waits == ["aten._local_scalar_dense.default", "aten.nonzero.default"]
    assert detector.found[0].where == "vskipper/mixed/sized.py:2 in sized" and detector.found[0].own
    assert not detector.found[1].own and detector.found[1].where.endswith("in test_the_cpu_detector_records_each_"
                                                                          "wait_with_its_site")


def test_the_wait_detector_sees_a_copy_to_the_host_of_what_the_pass_made_and_not_of_what_it_was_handed():
    """`tolist()`, `numpy()`, `cpu()` and `to()` the host never reach the dispatcher on CPU; on a GPU each of a
    device value is a copy the host waits for (`to()` a dtype alone is not). The detector records them for a tensor
    the pass's operators made or wrote (a view of it too), not for one the host handed the pass (SGLang's host
    mirrors)."""
    from vskipper.mixed.kernels import cohort_maps

    given, written = torch.arange(4), torch.zeros(4)
    run = torch.tensor([True, False, True])
    maps = (torch.empty(3, dtype=torch.int64), torch.empty(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
            torch.empty(3, dtype=torch.bool))
    detector = HostWaitDetector()
    with detector:
        made = given * 2
        written.add_(1)
        given.tolist(), given.numpy(), given.cpu(), run.tolist(), given.to("cpu")
        made.view(2, 2)[0].tolist(), made.numpy(), written.cpu()
        made.to(torch.float64), made.to(torch.device("cpu")), written.to(given), written.to(device="cpu")
        cohort_maps(run, *maps)  # a Triton launch writes the counts: on a GPU a device value
        maps[2].tolist()
    assert detector.waits == ["Tensor.tolist", "Tensor.numpy", "Tensor.cpu", "Tensor.to", "Tensor.to", "Tensor.to",
                              "Tensor.tolist"]
    assert maps[2].tolist() == [2, 1]


@pytest.fixture
def fake_mode(monkeypatch):
    """torch's CUDA sync debug mode as a value (no CUDA runtime here)."""
    mode = {"now": 0, "set": []}

    def set_mode(value):
        mode["set"].append(value)
        mode["now"] = {"default": 0, "warn": 1, "error": 2}.get(value, value)

    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode["now"])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    return mode


def test_the_device_watch_records_every_synchronizing_call_with_its_site_and_restores_the_mode(fake_mode,
                                                                                                monkeypatch):
    """Every call (a warning per call, not once per line, whatever the filters outside), each at its site, and the
    explicit synchronizes the mode does not report; another warning is shown as before, not swallowed; the mode
    in force before and the synchronizes come back, after an error too."""
    source = compile(f"import warnings\ndef read():\n    warnings.warn({SYNC_MESSAGE + ' (Triggered internally)'!r})\n",
                     os.path.join(PACKAGE, "mixed", "reads.py"), "exec")
    scope = {}
    exec(source, scope)
    shown, synced = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synced.append("device"))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: synced.append("event"))
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # Python's own: once per line, which the watch must override
        warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))
        with DeviceSyncWatch() as watch:
            assert fake_mode["now"] == 1  # 'warn': the calls go on, each one reported
            for _ in range(3):
                scope["read"]()
            warnings.warn("something else", stacklevel=1)
            torch.cuda.synchronize()  # which the mode does not report
            torch.cuda.Event.synchronize(None)
        assert fake_mode["now"] == 0 and shown == ["something else"] and synced == ["device", "event"]
        torch.cuda.synchronize()  # restored: no longer recorded
        with pytest.raises(ValueError), DeviceSyncWatch():
            raise ValueError("a pass that failed")
        assert fake_mode["set"] == ["warn", 0, "warn", 0]
    assert watch.waits == ["a synchronizing CUDA call"] * 3 + ["torch.cuda.synchronize", "Event.synchronize"]
    assert {w.where for w in watch.found[:3]} == {"vskipper/mixed/reads.py:3 in read"}
    assert all(w.own for w in watch.found[:3]) and not any(w.own for w in watch.found[3:])


def test_each_device_gets_its_detector_and_a_watch_that_sees_no_known_wait_is_not_live(monkeypatch):
    assert isinstance(host_waits.host_waits(torch.device("cuda")), DeviceSyncWatch)
    assert isinstance(host_waits.host_waits(torch.device("cpu")), HostWaitDetector)
    assert host_waits.live(torch.device("cpu")) is None
    monkeypatch.setattr(HostWaitDetector, "_waits", lambda self, func, args, kwargs: False)  # blind
    assert host_waits.live(torch.device("cpu")) == "a scalar read of a device value was not seen"
    if not torch.cuda.is_available():
        assert host_waits.live(torch.device("cuda")).startswith("the watch did not start: ")
