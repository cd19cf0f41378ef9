r"""captum_normattr.models.capture."""

__all__ = []
