"""zoneq export: the event log and the queue as JSON lines or Parquet files."""
