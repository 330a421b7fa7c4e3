"""Helpers shared by several packages, one home each: child processes (`spawn`) and child servers
(`serve`), free ports (`ports`), atomic and private files and a child's config (`files`), waiting
with a deadline (`wait`), the run directory's names (`run_paths`), JSON (`jsonio`), server-sent
events (`sse`), the config tree's location. Nothing here knows about cells, engines or the proxy."""

from importlib.resources import files

CONF_DIR = str(files("gyre.conf"))
"""The Hydra config tree: `conf/` in a checkout (installed editable), `gyre/conf` in an installed Gyre."""
