"""Errors meant for users: their message says what went wrong and what to do."""

__all__ = ["SemanticError", "ModelError", "ContextTooLong"]


class SemanticError(Exception):
    """An error whose message is fit to show a user as it is."""


class ModelError(SemanticError):
    """A model cannot be found, prepared or loaded."""


class ContextTooLong(SemanticError):
    """The prompt leaves no room for a reply in the model's context window (a
    reply that would run past the context stops at its end instead: reason ``length``)."""
