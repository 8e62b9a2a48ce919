"""What pyproject.toml cannot declare.

- The package list. The patches live at the repository's top level (`patches/`, one module per patch) and ship
  as `megatron_lora_patch.patches` through setuptools' package-dir mapping below; `[tool.setuptools.packages.find]`
  cannot add a remapped package, so the whole list is here. No top-level `patches` package is installed. An
  editable install (`pip install -e .`) maps the same name through setuptools' editable finder; a bare checkout
  through `megatron_lora_patch/_checkout.py`. Checked by tests/test_bootstrap.py (wheel) and
  tests/test_editable_install.py.
- The start-up hook `megatron_lora_patch-init.pth` must sit at the wheel's root (site-packages), beside the
  package, and setuptools has no declarative way to put a file there. Editable installs get it too: without it
  a training process would get no patch at all.

Everything else (metadata, entry points, package data) is in pyproject.toml.
"""

import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "megatron_lora_patch-init.pth"
HERE = os.path.dirname(os.path.abspath(__file__))
#: The import name of the top-level `patches/` directory (its only name: no top-level `patches` is installed).
PATCHES = "megatron_lora_patch.patches"
PACKAGES = (
    find_packages(HERE, include=["megatron_lora_patch", "megatron_lora_patch.*"])
    + [PATCHES]
    + [f"{PATCHES}.{name}" for name in find_packages(os.path.join(HERE, "patches"))]
)


class BuildWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list:
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


class EditableWithStartupHook(editable_wheel):
    """The editable wheel's root is written from `installation_dir` (setuptools 64+ puts its
    namespace `.pth` files there through this method); add ours next to them. Checked by
    tests/test_editable_install.py::test_editable_install_has_the_start_up_hook."""

    def _install_namespaces(self, installation_dir, pth_prefix):  # type: ignore[no-untyped-def]
        super()._install_namespaces(installation_dir, pth_prefix)
        self.copy_file(os.path.join(HERE, PTH), os.path.join(installation_dir, PTH))


setup(
    packages=PACKAGES,
    package_dir={PATCHES: "patches"},
    cmdclass={"build_py": BuildWithStartupHook, "editable_wheel": EditableWithStartupHook},
)
