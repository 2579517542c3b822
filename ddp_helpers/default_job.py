"""The default job: a run on this machine (`engines.local`), where `make_launch_config` sends a launch that names no
other job, and whose warm process `%load_ext ddp_helpers` starts. The one module outside the engines that names an
engine (tests/test_structure.py holds it so)."""

from __future__ import annotations

from .engines.local import Hardware, LocalJob, detect_hardware  # noqa: F401 - the default job, and this machine
from .engines.local.engine import (  # noqa: F401 - its stop bound and warm start, as users and tests name them
    SHUTDOWN_GRACE_S, STOP_BOUND_S, prepare_warm_launches,
)
