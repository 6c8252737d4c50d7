"""Delivery: MX resolution and the SMTP client side.  Never imports storage: a zone worker
gets leases and body chunks over IPC from the core, which alone owns the database."""
