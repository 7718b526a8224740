"""Every docstring example in fxpar runs and prints what it shows (docstrings are the docs)."""

import doctest
import importlib
import pkgutil

import pytest

import fxpar
import fxpar.cost
import fxpar.passes

# fxpar.cost and fxpar.passes live in cost/ and passes/ (package-dir), so walk each package.
MODULES = sorted({m.name for pkg in (fxpar, fxpar.cost, fxpar.passes)
                  for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")}
                 | {"fxpar", "fxpar.cost"})


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert res.failed == 0, f"{res.failed} of {res.attempted} doctest examples failed in {name}"
