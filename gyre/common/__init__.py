"""Helpers shared by several packages: child servers, dying with the parent, private files, the
config tree's location. Nothing here knows about cells, engines or the proxy."""

from importlib.resources import files

CONF_DIR = str(files("gyre.conf"))
"""The Hydra config tree: `conf/` in a checkout (installed editable), `gyre/conf` in an installed Gyre."""
