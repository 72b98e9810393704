"""The cache directory, the ground floor of cachefeed: its layout, segment format, budget, pins and read receipts.

Imports nothing of ``config``, ``daemon`` or ``trainer`` (``tests/test_public_api.py`` checks). Internal: the
stable names are those of ``cachefeed/__init__.py`` (``Snapshot`` among them); the modules here may change.
"""
