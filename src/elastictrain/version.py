"""The package version, alone in a module: any module reads it without importing the entry points."""

__version__ = "0.1.0"
