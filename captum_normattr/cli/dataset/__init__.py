r"""captum_normattr.cli.dataset."""
