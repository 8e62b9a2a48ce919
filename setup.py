"""Package layout and the start-up hook; everything else is declared in pyproject.toml.

- `patches/` ships inside the package as `megatron_lora_patch.patches` (never as a bare
  top-level `patches` module); the other subpackages are found automatically.
- `megatron_lora_patch-init.pth` goes to the wheel root (site-packages): setuptools has no
  declarative way to place a file there. Editable installs (`pip install -e .`) get it too:
  without it a training process would get no patch at all.
"""

import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "megatron_lora_patch-init.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list:
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


class EditableWithStartupHook(editable_wheel):
    """The editable wheel's root is written from `installation_dir` (setuptools 64+ puts its
    namespace `.pth` files there through this method); add ours next to them. Checked by
    tests/test_bootstrap.py::test_editable_install_has_the_start_up_hook."""

    def _install_namespaces(self, installation_dir, pth_prefix):  # type: ignore[no-untyped-def]
        super()._install_namespaces(installation_dir, pth_prefix)
        self.copy_file(os.path.join(HERE, PTH), os.path.join(installation_dir, PTH))


setup(
    packages=find_packages(include=["megatron_lora_patch", "megatron_lora_patch.*"]) + ["megatron_lora_patch.patches"],
    package_dir={"megatron_lora_patch.patches": "patches"},
    cmdclass={"build_py": BuildWithStartupHook, "editable_wheel": EditableWithStartupHook},
)
