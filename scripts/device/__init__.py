"""Runs and probes for the lent GPU machine (device-run.sh drives one batch there)."""
