"""Helpers shared by several packages: child servers, dying with the parent, private files, the
config tree's location. Nothing here knows about cells, engines or the proxy."""

from pathlib import Path

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
"""The Hydra config tree, package data: found the same in an editable and an installed Gyre."""
