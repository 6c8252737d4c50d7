"""zoneq analytics: the PySpark job that turns event exports into per-zone reports."""
