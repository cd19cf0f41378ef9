r"""captum_normattr.arch.families."""
