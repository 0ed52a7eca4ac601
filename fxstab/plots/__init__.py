"""Pictures of digit maps (interim: the module moved into a package; its parts follow)."""

from .draw import *  # noqa: F401,F403

