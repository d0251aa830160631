"""Type-check the shipped packages with mypy, under their import names (run by .ci/run).

The source folders are not named as their packages (``client/`` is ``kvd_client``,
``engine_patch/`` is ``kvd_engine``), and mypy cannot follow setuptools' editable-install
finder, so this lays a tree of links named as the packages under ``build/typecheck`` and
checks ``-p kvd -p kvd_client -p kvd_engine`` there with the settings in pyproject.toml.

Usage: python tools/typecheck.py [extra mypy arguments]
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

from mypy import api

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"kvd": "kvd", "kvd_client": "client", "kvd_engine": "engine_patch"}
TREE = ROOT / "build" / "typecheck"


def link_tree() -> pathlib.Path:
    """``build/typecheck/<import name>`` -> the source folder, for each package."""
    shutil.rmtree(TREE, ignore_errors=True)
    TREE.mkdir(parents=True)
    for name, folder in PACKAGES.items():
        os.symlink(ROOT / folder, TREE / name, target_is_directory=True)
    return TREE


def main(argv: list[str]) -> int:
    tree = link_tree()
    args = ["--config-file", str(ROOT / "pyproject.toml")]
    for name in PACKAGES:
        args += ["-p", name]
    os.chdir(tree)
    stdout, stderr, status = api.run([*args, *argv])
    sys.stdout.write(stdout.replace(str(tree) + os.sep, ""))
    sys.stderr.write(stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
