"""Keeping a store healthy: gc, repair, migrate, retention, statistics and listings."""
