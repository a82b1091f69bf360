"""Modules the tests import: shared helpers (no fixtures, no tests)."""
