"""Where a store's bytes may live besides its directory: the pinned memory tier."""
