"""The repository: snapshots and the index, one verified read, locks, tiers' interface, damage records."""
