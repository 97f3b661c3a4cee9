"""The package list, found rather than written (the rest of the metadata is in pyproject.toml).

pyproject.toml's ``[tool.setuptools.packages.find]`` cannot name the two folders that install
under another name (``backends/`` as ``parallelx.backends``, ``recipes/`` as ``parallelx.recipes``,
mapped in its ``[tool.setuptools.package-dir]``), and a hand-written list misses every new
subpackage: so every package under parallelx/, backends/ and recipes/ is found here.
tests/system/test_wheel.py builds the wheel and checks that it holds every module of the checkout.
"""

from setuptools import find_packages, setup

MAPPED = {"parallelx.backends": "backends", "parallelx.recipes": "recipes"}

packages = find_packages(include=["parallelx", "parallelx.*"])
for name, folder in MAPPED.items():
    packages += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]

setup(packages=packages)
