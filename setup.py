"""Only what pyproject.toml cannot say: the package list, and ``zero_strategy_autoload.pth``.

Packages: the top-level folder ``integrations/`` is installed as the subpackage
``zero_strategy.integrations`` (a ``package_dir`` mapping), so no top-level package
named ``integrations`` lands in site-packages -- a user's own ``integrations/`` folder
would shadow it.  pyproject.toml can declare the mapping but cannot combine it with
package discovery, hence the list is computed here.

Start-up hook: the .pth file makes every interpreter in the environment run
``import zero_strategy_autoload`` at start-up (see that module), which is how
``Trainer(strategy="zero3")`` works without the user importing this project.
setuptools has no option for a file at the top of site-packages, so ``build_py``
writes it: into the build directory for ``pip install .`` (wheels), and straight into
the editable wheel for ``pip install -e .`` (where build_py does not copy sources).
"""
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH_NAME = "zero_strategy_autoload.pth"
# One line; "import" lines of .pth files are executed by site.py.  The try/except keeps
# interpreter start-up quiet if the module was removed but the .pth was left behind.
PTH_LINE = "import sys; exec('try:\\n import zero_strategy_autoload\\nexcept ImportError:\\n pass')\n"


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            # editable_wheel: the install command's target is the unpacked wheel.
            target = Path(self.get_finalized_command("install").install_lib)
        else:
            target = Path(self.build_lib)
        target.mkdir(parents=True, exist_ok=True)
        (target / PTH_NAME).write_text(PTH_LINE)
        self._pth_output = str(target / PTH_NAME)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        pth = getattr(self, "_pth_output", None)
        if pth is not None and not getattr(self, "editable_mode", False):
            outputs = list(outputs) + [pth]
        return outputs


INTEGRATIONS = "zero_strategy.integrations"
PACKAGES = find_packages(include=["zero_strategy", "zero_strategy.*"]) + [
    INTEGRATIONS + name[len("integrations"):] for name in find_packages(include=["integrations", "integrations.*"])
]

setup(
    packages=PACKAGES,
    # Subpackages follow their parent: zero_strategy.integrations.lightning -> integrations/lightning.
    package_dir={INTEGRATIONS: "integrations"},
    cmdclass={"build_py": build_py_with_pth},
)
