"""Files and directories as snapshots: trees in and out, the files cache, followed directories, export."""
