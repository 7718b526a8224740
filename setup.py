"""Package layout (DESIGN §2): one import namespace. ``passes/`` installs as ``fxpar.passes`` and
``cost/`` as ``fxpar.cost``, so nothing generic lands in site-packages; every sub-package of
``fxpar/`` is found automatically."""

from setuptools import find_packages, setup

setup(
    packages=["fxpar", *(f"fxpar.{p}" for p in find_packages("fxpar")), "fxpar.passes", "fxpar.cost"],
    package_dir={"fxpar": "fxpar", "fxpar.passes": "passes", "fxpar.cost": "cost"},
)
