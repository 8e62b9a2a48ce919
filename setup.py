"""Package layout and the start-up hook; everything else is declared in pyproject.toml.

- `patches/` ships inside the package as `megatron_lora_patch.patches` (never as a bare
  top-level `patches` module); the other subpackages are found automatically.
- `megatron_lora_patch-init.pth` goes to the wheel root (site-packages): setuptools has no
  declarative way to place a file there.
"""

import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH = "megatron_lora_patch-init.pth"


class BuildWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        self.copy_file(os.path.join(here, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list:
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(
    packages=find_packages(include=["megatron_lora_patch", "megatron_lora_patch.*"]) + ["megatron_lora_patch.patches"],
    package_dir={"megatron_lora_patch.patches": "patches"},
    cmdclass={"build_py": BuildWithStartupHook},
)
