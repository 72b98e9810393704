"""The shared side of the benchmarks: data, the counting S3 server, samplers, the adapter protocol, the runner.

Nothing here knows a particular system; a system enters through :class:`adapter.SystemAdapter`.
"""
