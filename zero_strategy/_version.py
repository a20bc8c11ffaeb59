"""The library's version (one place: the package metadata and checkpoints' manifests read it)."""

__version__ = "0.1.0"
