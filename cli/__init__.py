"""The ``semantic`` command line."""
