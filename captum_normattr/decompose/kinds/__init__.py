r"""captum_normattr.decompose.kinds."""

__all__ = []
