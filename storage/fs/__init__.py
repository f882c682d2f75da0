"""The file system under the store: aligned direct I/O, descriptor reads, safe tree walks, ownership, markers."""
