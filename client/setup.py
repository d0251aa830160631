"""Package discovery for the client's distribution (``kvd-client``): this folder is ``kvd_client``
and every subpackage below it ships, found rather than listed (the repository's setup.py says why
pyproject.toml alone cannot map a folder onto another import name). This file is the build's, not
the package's: it is left out of the wheel, and importing it as ``kvd_client.setup`` (an editable
checkout walking its modules) does nothing, since setuptools runs it as ``__main__``."""

if __name__ == "__main__":
    from setuptools import find_packages, setup
    from setuptools.command.build_py import build_py

    class BuildPyWithoutThisFile(build_py):
        def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
            modules = super().find_package_modules(package, package_dir)
            return [m for m in modules if m[:2] != ("kvd_client", "setup")]

    setup(
        packages=["kvd_client", *(f"kvd_client.{sub}" for sub in find_packages(".", exclude=["build", "build.*"]))],
        package_dir={"kvd_client": "."},
        cmdclass={"build_py": BuildPyWithoutThisFile},
    )
