r"""captum_normattr.decompose.primitives."""

__all__ = []
