r"""captum_normattr.decompose.methods."""

__all__ = []
