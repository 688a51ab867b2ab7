"""The host memory a plan may park: offloaded boundaries live there, so a plan that needs more
than the machine has would be killed mid-step, after minutes of work."""

from __future__ import annotations

import os
from pathlib import Path

from segback.engine.options import AUTO

# Of the memory available when the plan is made, what the step's parked arrays may take (the
# rest: the process itself, the data loader, the optimizer's host copies and other programs).
HOST_FRACTION = 0.85


def available_host_gb(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    """Memory the OS can give this process now (Linux's MemAvailable, else the physical
    memory), GB; None where neither is known."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    except (ValueError, OSError, AttributeError):
        return None


def host_budget_gb(host_gb: float | str | None) -> float | None:
    """The planner's host limit: `host_gb` as given, or for "auto" HOST_FRACTION of the
    memory available now; None: no limit."""
    if host_gb != AUTO:
        return None if host_gb is None else float(host_gb)
    found = available_host_gb()
    return None if found is None else HOST_FRACTION * found
