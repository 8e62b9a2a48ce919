"""Ships the one-line start-up hook `megatron_lora_patch-init.pth` at the wheel root.

Everything else is declared in pyproject.toml; setuptools has no declarative way to
place a file at the root of site-packages.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "megatron_lora_patch-init.pth"


class BuildWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        self.copy_file(os.path.join(here, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list:
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildWithStartupHook})
