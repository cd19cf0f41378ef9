r"""captum_normattr.present."""
