"""Probe sets that record what the engine asks of them, for tests that check ranges and collectives.

Both derive from the engine's NullProbeSet, so every call of the probe protocol exists on them (a new call in the
protocol cannot leave a test's probes behind)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

from probes.probe_set import NullProbeSet


class RangeLog(NullProbeSet):
    """Collects (name, category) of every range the engine opens."""

    def __init__(self) -> None:
        self.ranges: list[tuple[str, str]] = []

    def range(self, name: str, category: str, **attrs: Any) -> contextlib.AbstractContextManager[None]:
        self.ranges.append((name, category))
        return super().range(name, category, **attrs)


class PhaseLog(NullProbeSet):
    """Logs every collective's issue and end, every range and every marked forward with the phase of the step the
    test loop has set."""

    def __init__(self) -> None:
        self.phase: tuple = ("init",)
        self.events: list[tuple[str, str, tuple]] = []

    def comm_issue(self, name: str, category: str, issue: Callable[[], Any], **attrs: Any) -> tuple[Any, Any]:
        self.events.append(("begin", name, self.phase))
        return issue(), name

    def comm_end(self, token: Any) -> None:
        self.events.append(("end", token, self.phase))

    def range(self, name: str, category: str, **attrs: Any) -> contextlib.AbstractContextManager[None]:
        self.events.append((category, name, self.phase))
        return super().range(name, category, **attrs)

    def forward_marker(self, module: Any, args: Any) -> None:
        self.events.append(("forward", module.marker, self.phase))
