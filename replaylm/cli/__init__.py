"""The ``replaylm`` command line (``python -m replaylm`` or the ``replaylm`` script)."""

from replaylm.cli.main import main

__all__ = ["main"]
