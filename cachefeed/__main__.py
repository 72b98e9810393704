"""``python -m cachefeed`` is the ``cachefeed`` command."""

from __future__ import annotations

import sys

from cachefeed._cli import main

sys.exit(main())
