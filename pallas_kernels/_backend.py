"""The former name of :mod:`pallas_kernels.backend`: this module *is* that one.

Kept for the modules that still import ``pallas_kernels._backend``; new code (inside
``pallas_kernels`` or out) imports :mod:`pallas_kernels.backend`. Importing this name
binds the same module object, so its registry, its functions and anything a test
patches on it are shared.
"""

import sys

from pallas_kernels import backend as _backend_module

sys.modules[__name__] = _backend_module
