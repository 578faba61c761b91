"""Where a pass makes the host wait for the device: on CPU, the operators that would (`HostWaitDetector`); on a GPU,
the synchronizing calls the device runtime reports (`DeviceSyncWatch`: torch's CUDA sync debug mode).

A routed pass that waits for a device value (a count read to size a tensor, a mask read to index one) stalls the
host until the device has run everything launched before: the launches of the rest of the pass then no longer
overlap the device's work, and such a pass cannot be captured in a CUDA graph. Each wait is recorded with the
nearest frame of vSkipper's code or of an engine's (`Wait`), so a wait of the engine's own path (an attention
backend a dense pass calls alike) is told apart from vSkipper's.

`host_waits(device)` gives the detector for a device: either one, as a context manager, records into `found`;
`live(device)` says whether it sees a known wait on this build.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import traceback
import warnings
from typing import NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ENGINES = ("sglang",)  # the packages whose frames are an engine's (a wait it makes for a dense pass too)
SYNC_MESSAGE = "called a synchronizing CUDA operation"  # what torch's sync debug mode warns with


class Wait(NamedTuple):
    """One wait: what waited (an operator, a copy to the host, the device runtime's synchronizing call), where (the
    nearest frame of vSkipper's code or of an engine's, as 'path:line in function'), and whether that frame is
    vSkipper's (`own`)."""

    what: str
    where: str
    own: bool


def site(stack: list[traceback.FrameSummary], engines: tuple[str, ...] = ENGINES) -> tuple[str, bool]:
    """(the innermost frame of `stack` in vSkipper's package or an engine's installed package, 'path:line in
    function' with the path from the package's parent; whether it is vSkipper's). Torch's and Triton's frames are
    passed over first. A stack in neither gives its innermost frame outside torch and Triton (the code that called
    them), not own."""
    own, libraries, engine_dirs = _roots(engines)
    caller = None
    for frame in reversed(stack):
        path = frame.filename
        if path.startswith(own):  # before the engines': vSkipper's own glue lives in vskipper/sglang/
            return _named(frame, os.path.dirname(own.rstrip(os.sep))), True
        if path.startswith(libraries):
            continue
        for root in engine_dirs:
            if path.startswith(root):
                return _named(frame, os.path.dirname(root.rstrip(os.sep))), False
        if caller is None:
            caller = frame
    return (_named(caller, "") if caller else "?"), False


@functools.cache
def _roots(engines: tuple[str, ...]) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(vSkipper's package directory, torch's and Triton's, the installed engines'), each ending in a separator:
    looked up once (a detector sites every operator it records, and the tests' launch counter every one)."""
    import triton

    import vskipper

    def package_dir(module) -> str:
        return os.path.dirname(module.__file__) + os.sep

    def installed_dir(name: str) -> str | None:  # without importing it
        spec = importlib.util.find_spec(name)
        locations = list(spec.submodule_search_locations or ()) if spec is not None else []
        return os.path.join(locations[0], "") if locations else None

    return (package_dir(vskipper), tuple(package_dir(m) for m in (torch, triton)),
            tuple(d for d in map(installed_dir, engines) if d))


def _named(frame: traceback.FrameSummary, root: str) -> str:
    path = os.path.relpath(frame.filename, root) if root else frame.filename
    return f"{path}:{frame.lineno} in {frame.name}"


def _caller_stack() -> list[traceback.FrameSummary]:
    """The stack of the call being recorded, without the detector's own frames (this module's)."""
    return [f for f in traceback.extract_stack() if f.filename not in (__file__, warnings.__file__)]


class _Recorder:
    """What both detectors record: each `Wait` (`found`), at the site of the call being recorded."""

    found: list[Wait]

    @property
    def waits(self) -> list[str]:
        return [w.what for w in self.found]

    def record(self, what: str) -> None:
        where, own = site(_caller_stack())
        self.found.append(Wait(what, where, own))


class _HostCopies(TorchFunctionMode):
    """`HostWaitDetector`'s reads that never reach the dispatcher on CPU: `tolist()`, `numpy()`, `cpu()` and
    `to()` the host of a tensor the pass's own operators made or wrote (on a GPU a device value: each a copy the
    host waits for)."""

    COPIES = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}

    def __init__(self, detector: HostWaitDetector) -> None:
        super().__init__()
        self.detector = detector

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        copies = func in self.COPIES or (func is torch.Tensor.to and _to_host(args[1:], kwargs))
        if copies and not self.detector._exempt and self.detector.made(args[0]):
            self.detector.record(f"Tensor.{func.__name__}")
        return func(*args, **kwargs)


def _to_host(args: tuple, kwargs: dict) -> bool:
    """Whether `Tensor.to(*args, **kwargs)` names the host as its device (a device, or a tensor on it)."""
    for target in (*args, kwargs.get("device"), kwargs.get("other")):
        if isinstance(target, torch.Tensor):
            target = target.device
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu":
            return True
    return False


class HostWaitDetector(_Recorder, TorchDispatchMode):
    """Records every operator that makes the host wait for the device: a scalar read (`aten._local_scalar_dense`),
    the operators whose output shape is a device value (`nonzero`, `unique`, `masked_select`, a boolean index,
    `repeat_interleave` without its output size), a tensor literal (`lift_fresh`: `torch.tensor(...)` in the
    pass, on a GPU a blocking copy from the host, and illegal while a graph captures), and a copy to the host
    (`tolist()`, `numpy()`, `cpu()`, `to()` the host) of a tensor the pass's operators made or wrote, or a Triton
    launch was handed (a tensor the host handed the pass, as SGLang's host mirrors, is not a device value). On CPU
    none of them waits, so the recorded names stand for the waits the same pass would make on a GPU, save a branch
    taken on CPU alone (RandomSkip's hash in numpy, which a device runs as tensor ops: in the torch execution's
    control passes). Within `exempt()` nothing is recorded: a call the host makes for a dense pass too (its
    attention backend's read). `waits` holds the names, `found` each `Wait` with its site."""

    SHAPE_FROM_VALUES = ("nonzero", "unique", "_unique", "unique_dim", "_unique2", "unique_consecutive",
                         "masked_select")

    def __init__(self):
        super().__init__()
        self.found: list[Wait] = []
        self._exempt = 0
        # the storages the pass's operators made or wrote, and their tensors (held, so no address is reused)
        self._made: set[int] = set()
        self._held: list[torch.Tensor] = []
        self._copies = _HostCopies(self)

    def __enter__(self):
        # a Triton launch's tensors are device tensors on a GPU, and the interpreter writes them outside torch's
        # dispatch: every tensor a launch is handed counts as made by the pass
        import triton.runtime.interpreter as interpreter

        real = self._real_launch = interpreter.InterpretedFunction.run

        def launch(fn, *args, **kwargs):
            for t in (*args, *kwargs.values()):
                self._mark(t)
            return real(fn, *args, **kwargs)

        interpreter.InterpretedFunction.run = launch
        self._copies.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        import triton.runtime.interpreter as interpreter

        try:
            return super().__exit__(*exc)
        finally:
            self._copies.__exit__(*exc)
            interpreter.InterpretedFunction.run = self._real_launch

    def made(self, t: torch.Tensor) -> bool:
        return isinstance(t, torch.Tensor) and storage_of(t) in self._made

    def _mark(self, t, handed: set[int | None] = frozenset(), written: bool = False) -> None:
        """`t`'s storage as made by the pass: unless it is the storage of a tensor handed to the call that made
        `t` (a view or alias) and the call did not write it."""
        if isinstance(t, torch.Tensor) and (ptr := storage_of(t)) is not None and (written or ptr not in handed):
            self._made.add(ptr)
            self._held.append(t)

    def exempt(self, fn):
        def call(*args, **kwargs):
            self._exempt += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._exempt -= 1
        return call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._exempt and self._waits(func, args, kwargs):
            self.record(str(func))
        out = func(*args, **kwargs)
        # what the operator made (new storage), or wrote: not a view or alias of what it was handed (a view of what
        # the pass made shares its storage already)
        handed = {storage_of(t) for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            self._mark(t, handed, func._schema.is_mutable)
        return out

    def _waits(self, func, args, kwargs) -> bool:
        name = func._schema.name.split("::")[-1]
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default) \
                or name in self.SHAPE_FROM_VALUES:
            return True
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            return any(t is not None and t.dtype == torch.bool for t in indices)
        if name == "repeat_interleave":  # repeats given as a tensor: the output's length is their sum
            return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
        return False


def storage_of(t: torch.Tensor) -> int | None:
    """The address of a tensor's storage; None where it has none (a functional or sparse tensor) or holds nothing
    (every empty storage's address is 0)."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return ptr or None


class DeviceSyncWatch(_Recorder):
    """Records each synchronizing call the CUDA runtime makes meanwhile, each with its site, into `found`: what
    torch's sync debug mode reports at 'warn' (a scalar read, a copy to the host, an output sized by device values,
    a blocking copy from pageable host memory, a stream's synchronize), and `torch.cuda.synchronize()` and an
    event's `synchronize()`, which that mode does not report. The calls go on: every wait of a pass is seen, not
    only the first. Not seen: what torch's mode does not cover (its docs: torch.distributed and torch.sparse), an
    operator called through `torch.ops` (no Python warning handler on that path: its warning goes to stderr), and
    a wait inside an extension that does not go through torch's CUDA helpers. `live` says whether the mode
    reports at all on this build."""

    def __init__(self) -> None:
        self.found: list[Wait] = []

    def __enter__(self):
        self._mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")  # first: where CUDA cannot take it, nothing is replaced yet
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")  # every call, not once per line
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_MESSAGE in str(message):
                self.record("a synchronizing CUDA call")
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        self._replaced = [(owner, "synchronize", owner.synchronize) for owner in (torch.cuda, torch.cuda.Event)]
        for owner, name, real in self._replaced:
            setattr(owner, name, self._recording(f"{owner.__name__}.{name}", real))
        return self

    def _recording(self, what: str, real):
        def call(*args, **kwargs):
            self.record(what)
            return real(*args, **kwargs)
        return call

    def __exit__(self, *exc):
        try:
            torch.cuda.set_sync_debug_mode(self._mode)
        finally:
            for owner, name, real in self._replaced:
                setattr(owner, name, real)
            self._warnings.__exit__(*exc)


def live(device: torch.device) -> str | None:
    """Whether `host_waits(device)` sees a wait here: a scalar read of a value made on the device, watched; None
    where it was seen, else why not (a build whose sync report reaches no Python warning would report every pass
    as waiting for nothing)."""
    try:
        with host_waits(device) as watch:
            torch.ones(1, device=device).add(1).item()
    except Exception as exc:  # noqa: BLE001 (a watch that cannot start is the answer)
        return f"the watch did not start: {type(exc).__name__}: {str(exc).strip()[:200]}"
    return None if watch.found else "a scalar read of a device value was not seen"


def host_waits(device: torch.device) -> HostWaitDetector | DeviceSyncWatch:
    """The detector of a pass's host waits on `device`: the device runtime's own report on CUDA, the operators
    that would wait on a GPU elsewhere (on CPU nothing waits)."""
    return DeviceSyncWatch() if device.type == "cuda" else HostWaitDetector()
