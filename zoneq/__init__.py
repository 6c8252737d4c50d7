"""zoneq: a LevelDB-backed, zone-routing outbound mail delivery engine."""

__version__ = "0.1.0"
