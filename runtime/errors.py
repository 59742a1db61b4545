"""Errors meant for users: their message says what went wrong and what to do."""

__all__ = ["SemanticError", "ModelError"]


class SemanticError(Exception):
    """An error whose message is fit to show a user as it is."""


class ModelError(SemanticError):
    """A model cannot be found, prepared or loaded."""
