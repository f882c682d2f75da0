"""Operations that can freeze or kill a workload: their journal records, snapshot metadata, and
`gpusnap recover`, which finishes or undoes what a crash left in flight."""
