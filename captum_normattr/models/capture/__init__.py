r"""captum_normattr.models.capture."""
