"""The package version, in one place (read by the package and by digit maps' metadata)."""

__version__ = "0.1.0"
