r"""captum_normattr.decompose.methods.decompx."""
