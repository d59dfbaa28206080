"""Repeatable micro-benchmarks of replaylm (not part of the package): run each as
``PYTHONPATH=. python benchmarks/NAME.py`` from the repository root. See README.md here."""
