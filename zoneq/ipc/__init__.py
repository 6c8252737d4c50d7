"""IPC between the core, which alone owns the queue, and the zone workers that deliver.

A worker connects to the core's Unix socket (``IpcServer`` in the core, ``IpcClient`` in a
worker) and speaks length-prefixed msgpack frames (``framing``) carrying the verbs of
``messages``: hello, lease, chunk, report.  Sits below ``zoneq.delivery`` and above
``zoneq.storage``, and imports neither: the core's queue service implements
``CoreHandler``, and workers use the client.
"""
