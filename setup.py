"""Build hook: installs ``lightning_dcp_strategies.pth`` next to the package in site-packages.

Lightning resolves ``Trainer(strategy="dcp")`` from its own registry and has no entry point for
third-party strategies, so the name exists only once ``lightning_dcp`` was imported. The ``.pth``
line runs at interpreter start-up and imports ``lightning_dcp`` -- which loads neither torch nor
Lightning, only a one-shot import hook (:mod:`lightning_dcp._registry`) -- so ``strategy="dcp"``
works after ``pip install lightning-dcp`` in any script, with no import of ours. Editable installs
(``pip install -e``) do not get the file: there, ``import lightning_dcp`` first.
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
