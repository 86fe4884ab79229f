"""Packaging that pyproject.toml cannot express: the repository's top-level data folders install inside
the kvhub package, so a user's environment never gets top-level modules named ``registry`` or
``migrations``.

    registry/    -> kvhub._registry     (model registry, calibration recipes, shipped configs)
    migrations/  -> kvhub._migrations   (the Alembic environment behind `kvhub db upgrade`)

Everything else (name, version, dependencies, entry points) is in pyproject.toml.
"""

from setuptools import find_packages, setup

DATA_PACKAGES = {"kvhub._registry": "registry", "kvhub._migrations": "migrations"}

setup(
    packages=[*find_packages(include=["kvhub", "kvhub.*"]), *DATA_PACKAGES],
    package_dir=DATA_PACKAGES,
    package_data={
        "kvhub._registry": ["**/*.toml", "**/*.json"],
        "kvhub._migrations": ["*.mako", "alembic.ini", "versions/*.py"],
    },
)
