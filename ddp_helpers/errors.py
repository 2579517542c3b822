"""The error every layer may raise for bad launch input (kept apart so the rank side can import it light)."""


class LaunchError(ValueError):
    """Bad launch input, or a run folder that cannot be used, reported before any process starts."""
