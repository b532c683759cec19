"""Where ``palestra.kernels`` comes from: the kernels/ folder, whose package body is ``_package.py``.

The folder has no ``__init__.py``, so that from the repository root it does not hide Hugging Face's ``kernels``
package (see ``kernels/_package.py``). A folder without ``__init__.py`` would make ``palestra.kernels`` a namespace
package: no body, so no ``from palestra.kernels import gae`` and no op registration on import, and setuptools'
editable install does not even find a namespace package mapped to another folder. The finder below answers the
one name ``palestra.kernels`` with a regular package: the folder as its path, ``_package.py`` as its body. It runs
on import, like an ``__init__.py`` would, before any of its modules.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib.machinery import ModuleSpec

NAME = "palestra.kernels"
BODY = "_package.py"


def _folder() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    # installed: site-packages/palestra/kernels; the source tree (an editable install): core/../kernels
    for folder in (os.path.join(here, "kernels"), os.path.join(os.path.dirname(here), "kernels")):
        if os.path.isfile(os.path.join(folder, BODY)):
            return folder
    return None


class KernelsFinder:
    """A meta path finder for ``palestra.kernels`` alone; every other name goes to the usual finders."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if name != NAME:
            return None
        folder = _folder()
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            NAME, os.path.join(folder, BODY), submodule_search_locations=[folder]
        )


def install() -> None:
    # first: an editable install's own finder maps palestra.kernels to the folder, finds no __init__.py and says no
    if KernelsFinder not in sys.meta_path:
        sys.meta_path.insert(0, KernelsFinder)
