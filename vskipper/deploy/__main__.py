"""`python -m vskipper.deploy [--check] [--root DIR]`: write (or check) every generated deployment file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

RULES_FILE = Path("helm/vskipper/files/prometheus-rules.yaml")
DASHBOARD_FILE = Path("helm/vskipper/files/dashboard.json")


def generated_files(root: Path) -> dict[Path, str]:
    from vskipper.deploy import chart
    from vskipper.deploy.dashboard import render_dashboard_json
    from vskipper.deploy.rules import render_rules_yaml

    return {**chart.generated_files(root), RULES_FILE: render_rules_yaml(), DASHBOARD_FILE: render_dashboard_json()}


def drifted(root: Path) -> list[Path]:
    """Generated files whose committed text differs from what the generators produce now."""
    out = []
    for rel, text in generated_files(root).items():
        path = root / rel
        if not path.exists() or path.read_text() != text:
            out.append(rel)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vskipper.deploy", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail when a committed file differs; write nothing")
    parser.add_argument("--root", default=".", help="repository root")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if args.check:
        stale = drifted(root)
        for rel in stale:
            print(f"{rel} is out of date: run `make chart`", file=sys.stderr)
        return 1 if stale else 0
    for rel, text in generated_files(root).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
