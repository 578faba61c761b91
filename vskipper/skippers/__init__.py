"""Skippers: per-row, per-routed-layer RUN / PROJECT_ONLY policies.

Importing this package is torch-free (the registry and the declared parameters of every skipper); the plugin
modules (`trained_gate`, `random_skip`, `static_depth`) and the interface in `base` import torch.
"""

from vskipper.skippers.registry import (
    FLEXIDEPTH_ADAPTER,
    PHASES,
    WHOLE_LAYER_ACTIONS,
    Action,
    ParamSpec,
    SkipperConfigError,
    SkipperEntry,
    build_skipper,
    get_entry,
    register_skipper,
    registered,
    unregister_skipper,
)

__all__ = [
    "FLEXIDEPTH_ADAPTER", "PHASES", "WHOLE_LAYER_ACTIONS", "Action", "ParamSpec", "SkipperConfigError",
    "SkipperEntry", "build_skipper", "get_entry", "register_skipper", "registered", "unregister_skipper",
]
