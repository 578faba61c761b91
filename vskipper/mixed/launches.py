"""What a pass launches, counted on any device: torch operators that compute or copy data (one device kernel each
on a GPU, and a host dispatch each wherever they run) and Triton kernel launches under the interpreter.

On a GPU a prefill pass and an eager decode pass are bound by the host wherever its launches take longer than
their kernels run; a count per pass, arm by arm, says where a routed pass's host work goes with no device to time
it. Views, metadata and uninitialized allocations launch nothing and are not counted (`NO_LAUNCH`).

`interpreted_launches(count, run=False)` records each Triton launch by kernel name and, with `run` False, skips
the kernel itself: what the host does around a launch stays timed, the interpreter's execution of the kernel (its
program run element by element in Python, far slower than any device) does not; the kernel's outputs then hold
whatever their storage held. Only under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch.utils._python_dispatch import TorchDispatchMode

# operators that launch no device work: views, metadata, uninitialized allocations
NO_LAUNCH = frozenset({
    "view", "_unsafe_view", "slice", "select", "as_strided", "t", "transpose", "expand", "unsqueeze", "squeeze",
    "reshape", "alias", "detach", "permute", "split", "split_with_sizes", "unbind", "narrow", "empty", "empty_like",
    "new_empty", "empty_strided", "_reshape_alias", "view_as", "scalar_tensor", "sym_size", "sym_stride",
    "sym_numel", "is_same_size", "promote_types", "result_type"})


class LaunchCount(TorchDispatchMode):
    """Counts the operators dispatched meanwhile that launch device work (by name, `ops`), those for which `keep`
    (no argument) says True, every one where it is None; with `interpreted_launches(self.triton)`, the Triton
    launches too."""

    def __init__(self, keep: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self.keep = keep
        self.ops: Counter[str] = Counter()
        self.triton: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_LAUNCH and (self.keep is None or self.keep()):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values()) + sum(self.triton.values())


@contextmanager
def interpreted_launches(count: Counter[str] | Callable[[str], None], run: bool = True) -> Iterator[None]:
    """Meanwhile each Triton launch is recorded by its kernel's name (into a Counter, or by a callable) and, where
    `run` is False, not executed. The interpreter's kernels run outside any torch dispatch mode (the operators a
    kernel's Python executes are the kernel's own, not the host's)."""
    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import _disable_current_modes

    real = interpreter.InterpretedFunction.run
    note = count if callable(count) else None

    def launch(fn, *args, **kwargs):
        name = fn.fn.__name__
        if note is not None:
            note(name)
        else:
            count[name] += 1
        if not run:
            return None
        with _disable_current_modes():
            return real(fn, *args, **kwargs)

    interpreter.InterpretedFunction.run = launch
    try:
        yield
    finally:
        interpreter.InterpretedFunction.run = real
