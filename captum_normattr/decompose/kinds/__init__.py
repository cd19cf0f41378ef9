r"""captum_normattr.decompose.kinds."""
