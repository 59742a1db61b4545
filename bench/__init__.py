"""Benchmarks behind ``semantic bench``: medians of repeated runs, printed as
tables or one JSON object."""
