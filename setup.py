"""Packaging is in pyproject.toml; this file only adds `sglang_tiered_boot.pth` to the wheel's root (see
sglang_tiered_boot.py for why SGLang on a CPU-only torch needs it)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        shutil.copy(Path(__file__).parent / "sglang_tiered_boot.pth", Path(self.build_lib) / "sglang_tiered_boot.pth")

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / "sglang_tiered_boot.pth")]


setup(cmdclass={"build_py": BuildPyWithPth})
