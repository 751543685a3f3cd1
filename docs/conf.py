"""Sphinx configuration of cupykv's documentation: ``sphinx-build -W -b html docs docs/_build/html``.

The API reference comes from the docstrings (numpydoc); the Markdown pages
and the emulator's README through MyST; the notebooks are rendered from
their committed outputs, never executed here.
"""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import cupykv  # noqa: E402

project = "cupykv"
author = "the cupykv developers"
copyright = "2026, the cupykv developers"
release = version = cupykv.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_nb",
]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "gpu", "**/.ipynb_checkpoints"]

# The notebooks' committed outputs are the documentation; the test suite executes them.
nb_execution_mode = "off"
myst_heading_anchors = 3

autosummary_generate = True
# members a module defines itself; names it re-exports (CacheSpec in cupykv.reference) are documented once
autodoc_default_options = {"members": True, "show-inheritance": True, "ignore-module-all": True}
autodoc_typehints = "none"          # the numpydoc sections carry the types
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
# Missing docstrings are a test failure instead (tests/test_docs.py walks every public name).

# Broken cross-references fail the build (-W); types named in prose or from other projects are not links.
nitpicky = True
nitpick_ignore_regex = [
    ("py:class", r"(numpy|np|cupy|ml_dtypes|optional|callable|array|device array|host array|array-like|int|float|"
                 r"str|bool|tuple|list|dict|None|sequence|iterable|Any|type|object|default|of|or).*"),
    ("py:class", r".*(\[|\]|\"|'|``|`|\{|\}).*"),
    ("py:class", r"(hypothesis|weakref|collections|typing|pathlib|dataclasses)\..*"),
    ("py:class", r"[a-z_ ]+"),
    ("py:obj", r".*"),
]

html_theme = "alabaster"
html_title = f"cupykv {release}"
