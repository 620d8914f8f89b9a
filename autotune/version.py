"""The package's version, in a module of its own: the parts that write it into results and reports import it
from here, not from the package root (whose lazy names reach up to every stage)."""

__version__ = "0.1.0"
