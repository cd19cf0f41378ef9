r"""captum_normattr.decompose.methods.decompx."""

__all__ = []
