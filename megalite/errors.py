"""The error every user mistake raises: one line naming the values and what to change (a leaf: it imports
nothing of megalite, so any module can raise it). `megalite.config.ConfigError` is this class."""


class ConfigError(ValueError):
    pass
