"""The HTTP admin and submission API (aiohttp), and the ``zoneq queue`` / ``zoneq send`` CLI.

``app.py`` builds the application from the core's parts; ``auth.py`` and ``errors.py`` are
its two middlewares; the views are grouped by what they touch (``submit.py``, ``browse.py``,
``operations.py``, ``export.py``, ``metrics.py``, ``suppression.py`` over the suppression
plugin's file in ``suppression_list.py``); ``openapi.py`` is the API's description, checked
against the routes by a test.  ``client.py``, ``command.py`` and ``suppression_command.py``
are the CLI side.
"""
