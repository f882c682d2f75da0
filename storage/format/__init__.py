"""The on-disk format (FORMAT.md): chunk files, packs and their index, manifests, the store's directories."""
