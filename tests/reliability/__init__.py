"""The reliability and security suite: real faults injected into a real daemon, cache and trainers (issue 8).

Every scenario prints one ``[reliability] <scenario>: key=value, ...`` line of counts; ``scripts/reliability.sh``
runs the full counts (``-m slow``) and collects those lines. See ``tests/reliability/common.py``.
"""
