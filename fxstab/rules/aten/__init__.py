"""The arithmetic-level rules (being split into modules; see apply.py for now)."""

from .apply import *  # noqa: F401,F403
from .apply import __all__  # noqa: F401
from .apply import _Analysis  # noqa: F401 - tests/test_counters.py, until the split names it
