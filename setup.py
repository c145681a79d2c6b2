"""Build hook: installs ``lightning_dcp_strategies.pth`` next to the package in site-packages.

Lightning resolves ``Trainer(strategy="dcp")`` from its own registry and has no entry point for
third-party strategies, so the name exists only once our registration ran. The ``.pth`` line runs at
interpreter start-up and calls ``_lightning_dcp_strategies.install()``, which loads only the one-shot
import hook ``lightning_dcp/_registry.py`` (no torch, no Lightning, not the package itself), so
``strategy="dcp"`` works after ``pip install lightning-dcp`` in any script, with no import of ours.
Editable installs (``pip install -e``) do not get the file: there, ``import lightning_dcp`` first.
The sdist carries the file through ``MANIFEST.in``.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "lightning_dcp_strategies.pth"


class BuildPyWithPth(build_py):
    """``build_py`` that also puts :data:`PTH` at the root of the wheel (site-packages once installed)."""

    def run(self) -> None:
        super().run()
        shutil.copy(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list:
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
