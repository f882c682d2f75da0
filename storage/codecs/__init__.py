"""Chunk codecs by on-disk id (the registry), their C and numpy helpers, and the page-delta encoding."""
