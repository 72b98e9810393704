"""The daemon's status document: its contract, and everything that reads it.

One job per module, each importing only those above it in this list:

- ``schema.py``: the contract, declared once (version, shape, which numbers are metrics).
- ``document.py``: reading ``<cache>/status.json`` and validating it against the schema.
- ``directory.py``: what a cache directory shows without a daemon (segments, snapshots, free space).
- ``verdict.py``: the health verdict on a document, whose value is the exit status of ``cachefeed status``
  (the exit-status table is there).
- ``report.py``: ``read_report``: a cache directory to a ``StatusReport`` (the verdict and what it was judged from).
- ``render.py``: a report as JSON (``--json``) or as 80 columns of text.
- ``metrics.py``: the Prometheus exporter the daemon feeds with each document it writes.

The daemon builds the document from its own state in ``_daemon/status_doc.py``; the ``cachefeed status`` command is
``_cli/status.py``. Nothing here imports the daemon, the trainer or torch, and nothing here writes into a cache.

Internal modules; the stable contract is the document itself (``schema.py``, ``STATUS_VERSION``) and
``cachefeed status``.
"""
