"""Every package of the source tree is in pyproject.toml's explicit `packages` list.

An editable install finds a subpackage that list forgot (it maps the top directories), so tests
pass; a wheel (`pip install .`, a user's `pip install hetlaunch`) leaves it out, and the first
import of it fails on the user's machine. launcher/providers was once such a package."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed_for_the_wheel():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for package, directory in setuptools["package-dir"].items():
        for init in (ROOT / directory).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / directory).parts
            found.add(".".join((package, *relative)))
    assert found, "no package found: the test reads the wrong tree"
    assert found - listed == set(), f"packages missing from pyproject.toml's packages: {sorted(found - listed)}"
    assert listed - found == set(), f"listed packages with no __init__.py: {sorted(listed - found)}"
