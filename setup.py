"""The package's one compiled part: runtime/model/kernels, the CPU kernels that
read a long agent's packed past and close and open its blocks, built as an MLX extension against the MLX
being installed (pyproject.toml holds everything else). A machine that
cannot build them installs without them: ``runtime.model.attention`` falls
back to MLX's quantized matmul and ops and says why."""

import warnings

from mlx import extension
from setuptools import setup


class BuildKernels(extension.CMakeBuild):
    def run(self) -> None:
        try:
            super().run()
        except Exception as error:  # a compiler, CMake or nanobind missing: run without the kernels
            warnings.warn(f"the CPU kernels were not built ({error}); MLX's quantized matmul and ops are used")


setup(ext_modules=[extension.CMakeExtension("semantic.runtime.model._packed", sourcedir="runtime/model/kernels")],
      cmdclass={"build_ext": BuildKernels})
