"""The vocabulary every other storage package uses: errors and exit codes, limits, settings, names, progress."""
