"""Package discovery for the daemon's distribution (``kvd``): every package under the three source
folders, found rather than listed, under its import name.

The folders are not named as they import (``client/`` is ``kvd_client``, ``engine_patch/`` is
``kvd_engine``), which pyproject.toml's ``packages.find`` cannot express: it would report ``client``
and ``client.v1``. So this file walks each folder with setuptools' own ``find_packages`` and maps
what it finds onto the import name; a new subpackage (as ``kvd/worker`` once was) ships without
anyone listing it. Everything else about the distribution is in pyproject.toml.
"""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

SOURCE_FOLDERS = {"kvd": "kvd", "kvd_client": "client", "kvd_engine": "engine_patch"}
"""Import name -> folder in this repository."""

BUILD_SCRIPTS = {("kvd_client", "setup")}
"""client/setup.py builds the client's own distribution: it sits in the folder, it is not a module."""


def discovered_packages() -> list[str]:
    """Each folder's package and every subpackage below it (a folder with an ``__init__.py``)."""
    packages: list[str] = []
    for name, folder in SOURCE_FOLDERS.items():
        packages.append(name)
        packages.extend(f"{name}.{sub}" for sub in find_packages(folder, exclude=["build", "build.*"]))
    return packages


class BuildPyWithoutBuildScripts(build_py):
    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        found = super().find_package_modules(package, package_dir)
        return [entry for entry in found if (entry[0], entry[1]) not in BUILD_SCRIPTS]


setup(
    packages=discovered_packages(),
    package_dir=SOURCE_FOLDERS,
    cmdclass={"build_py": BuildPyWithoutBuildScripts},
)
