"""The backends every kernel test runs on: the emulator always, CuPy when a GPU is usable."""
import pytest

BACKENDS = ["emulator", pytest.param("cupy", marks=pytest.mark.gpu)]
