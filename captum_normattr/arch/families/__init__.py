r"""The built-in family descriptions, one module per group (:mod:`~captum_normattr.arch.families.base` and the others).

:mod:`captum_normattr.arch.registry` registers them; nothing is imported here.
"""

__all__: list = []
