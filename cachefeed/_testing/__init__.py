"""Helpers for cachefeed's tests, its benchmarks and ``cachefeed demo``: not a stable API.

Real components to run cachefeed against, shared so that the demo, the tests and the benchmarks each use the
same one (the benchmarks never import ``tests/``):

- :mod:`cachefeed._testing.local_s3`: a real S3 HTTP API on loopback (moto's server as a subprocess).
- :mod:`cachefeed._testing.proxy`: an S3 reverse proxy in front of it that counts requests and injects faults.
- :mod:`cachefeed._testing.daemon`: the daemon as a subprocess on a test config (the config writer), and polling
  with a deadline.
- :mod:`cachefeed._testing.samples`: self-verifying samples, and the ``.npy`` objects the tests upload.
- :mod:`cachefeed._testing.witness`: a witness of the read promises that reads segment files, not the ledger.

Nothing here imports pytest (a test extra only); the pytest fixtures built on these live in ``tests/conftest.py``.
moto comes with the ``demo`` and ``test`` extras. Only ``cachefeed._cli.demo`` may import this package from inside
cachefeed; everything else in cachefeed stays independent of it.
"""
