"""pyproject.toml lists Gyre's packages by hand (the config tree maps `conf/` to `gyre.conf`): the list
must name every folder that ships, or an installed Gyre would miss code or config."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _folders(top: Path, package: str) -> set[str]:
    found = {package}
    for d in top.rglob("*"):
        if d.is_dir() and d.name != "__pycache__" and any(f.is_file() for f in d.iterdir()):
            found.add(".".join((package, *d.relative_to(top).parts)))
    return found


def test_every_folder_of_gyre_and_conf_is_a_listed_package():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"gyre.conf": "conf"}
    assert sorted(setuptools["packages"]) == sorted(
        _folders(ROOT / "gyre", "gyre") | _folders(ROOT / "conf", "gyre.conf")
    )


def test_the_config_tree_is_found_at_the_top_level_of_a_checkout():
    from gyre.common import CONF_DIR

    assert Path(CONF_DIR).resolve() == ROOT / "conf" and (ROOT / "conf" / "config.yaml").is_file()
