"""Make the PyPI torchvision 0.28.0 importable beside the CPU torch (one command, idempotent).

The PyPI wheel is a CUDA build: its `_C` extension does not load beside the CPU torch, so
`torchvision.extension._has_ops()` is False. `torchvision/_meta_registrations.py` still registers fake kernels
for `torchvision::nms` and `torchvision::qnms` unconditionally, and torch refuses (`operator torchvision::nms does
not exist`), which makes `import torchvision` fail. SGLang imports torchvision while loading its config package.

The fix guards those two registrations by `_has_ops()`, as the file already does for every other operator.
Image operators stay unavailable; text models never call them.

    python -m vskipper.sglang.shims.patch_torchvision [--check]

exits 0 when the installed torchvision is patched (or needs no patch), 1 with --check when it is not.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

UNGUARDED = '@torch.library.register_fake("torchvision::'
GUARDED = '@_register_fake_if_ops("torchvision::'
HELPER = '''

def _register_fake_if_ops(op_name):
    """torch.library.register_fake, only when torchvision's operators are loaded (vskipper CPU patch)."""
    def wrapper(fn):
        if torchvision.extension._has_ops():
            return torch.library.register_fake(op_name)(fn)
        return fn

    return wrapper
'''
ANCHOR = "import torchvision.extension  # noqa: F401\n"


def meta_registrations_file() -> Path:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("torchvision is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "_meta_registrations.py"


def patched_source(source: str) -> str:
    """The source with every unguarded fake registration guarded; unchanged when already patched."""
    if UNGUARDED not in source:
        return source
    if ANCHOR not in source:
        raise ValueError(f"unexpected torchvision/_meta_registrations.py: anchor {ANCHOR.strip()!r} not found")
    source = source.replace(UNGUARDED, GUARDED)
    if "def _register_fake_if_ops" not in source:
        source = source.replace(ANCHOR, ANCHOR + HELPER, 1)
    return source


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report only; exit 1 when a patch is needed")
    args = parser.parse_args(argv)
    path = meta_registrations_file()
    source = path.read_text()
    new = patched_source(source)
    if new == source:
        print(f"{path}: patched")
        return 0
    if args.check:
        print(f"{path}: not patched")
        return 1
    path.write_text(new)
    print(f"{path}: patched now")
    return 0


if __name__ == "__main__":
    sys.exit(main())
