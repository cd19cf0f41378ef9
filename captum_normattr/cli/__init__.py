r"""captum_normattr.cli."""
