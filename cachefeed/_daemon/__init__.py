"""The daemon: a supervisor process and its sampler subprocesses (``cachefeed daemon`` starts it; systemd runs it).

Internal: nothing here is a stable API; the daemon is configured by its TOML file and observed through its status
document (``cachefeed/_status``).
"""
