"""The Hydra config tree (`gyre-train`, `gyre-sim`), installed as the package `gyre.conf`."""
