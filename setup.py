"""The one thing pyproject.toml cannot declare: the start-up hook `megatron_lora_patch-init.pth` must
sit at the wheel's root (site-packages), beside the package, and setuptools has no declarative way to
put a file there. Editable installs (`pip install -e .`) get it too: without it a training process
would get no patch at all. Everything else (packages, entry points, data) is in pyproject.toml.
"""

import os

from setuptools import setup
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


setup(cmdclass={"build_py": BuildWithStartupHook, "editable_wheel": EditableWithStartupHook})
