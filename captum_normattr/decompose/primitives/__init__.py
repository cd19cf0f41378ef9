r"""captum_normattr.decompose.primitives."""
