"""Build hook: installs ``lightning_dcp_strategies.pth`` next to the package in site-packages.

Lightning resolves ``Trainer(strategy="dcp")`` from its own registry and has no entry point for
third-party strategies, so the name exists only once our registration ran. The ``.pth`` line runs at
interpreter start-up and calls ``_lightning_dcp_strategies.install()``, which loads only the one-shot
import hook ``lightning_dcp/_registry.py`` (no torch, no Lightning, not the package itself), so
``strategy="dcp"`` works in any script, with no import of ours, after every install:

* a wheel or sdist (``pip install lightning-dcp``, ``pip install .``): ``build_py`` puts the file at the
  root of ``build_lib``, which becomes the wheel's root (site-packages). The sdist carries the file
  through ``MANIFEST.in``;
* an editable install (``pip install -e .``, ``scripts/setup.sh``; PEP 660): setuptools' ``editable_wheel``
  runs ``build_py`` in editable mode and ships only what it writes to the unpacked wheel -- the directory
  it sets as ``install``'s ``install_lib`` -- so ``build_py`` copies the file there too. The line then
  imports ``_lightning_dcp_strategies`` from the source tree through setuptools' editable finder (whose
  ``__editable__.*.pth`` sorts, and so runs, first).
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "lightning_dcp_strategies.pth"


class BuildPyWithPth(build_py):
    """``build_py`` that also puts :data:`PTH` at the root of the wheel (site-packages once installed),
    editable wheels included."""

    def run(self) -> None:
        super().run()
        shutil.copy(PTH, os.path.join(self.build_lib, PTH))
        if getattr(self, "editable_mode", False):  # PEP 660: the editable wheel holds what install_lib holds
            unpacked_wheel = self.get_finalized_command("install").install_lib
            shutil.copy(PTH, os.path.join(unpacked_wheel, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list:
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
