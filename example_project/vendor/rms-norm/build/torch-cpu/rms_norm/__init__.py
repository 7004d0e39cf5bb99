"""A vendored RMSNorm kernel (the team's pinned copy), as kernel-builder lays out a torch-cpu build."""

from . import layers

__all__ = ["layers"]
