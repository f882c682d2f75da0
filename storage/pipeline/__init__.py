"""The write pipeline: streams in, chunks hashed, encoded and packed; encoder processes; the GPU engine."""
