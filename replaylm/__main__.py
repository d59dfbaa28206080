"""``python -m replaylm``: the same command line as the ``replaylm`` script."""

from replaylm.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
