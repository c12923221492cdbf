"""Package discovery for the one distribution (the metadata lives in pyproject.toml).

``notebook_dist/`` and every subpackage under it are found, not listed, so a new
subpackage ships by itself; ``magics/`` (a top-level folder by design) installs as
``notebook_dist.magics``, with its own subpackages found the same way.
tests/test_packaging.py builds the wheel and sdist and checks their modules against
the checkout.
"""

from setuptools import find_packages, setup

MAGICS = "notebook_dist.magics"

setup(
    packages=[
        *find_packages(include=["notebook_dist", "notebook_dist.*"]),
        MAGICS,
        *(f"{MAGICS}.{sub}" for sub in find_packages("magics")),
    ],
    package_dir={MAGICS: "magics"},
)
