"""Stub: see xprof/__init__.py."""
