"""The tests' name for ``local_fleet.threads`` (a fleet's nodes as threads over a real broker)."""

from local_fleet.threads import Running, ThreadFleet

__all__ = ["Running", "ThreadFleet"]
