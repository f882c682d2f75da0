"""Operations that can freeze or kill a workload: their journal records, snapshot metadata, and what every
journaled kind shares (the Operation and its one undo); each kind lives beside its flow, and `gpusnap
recover` (sandbox.recover) on the top floor finishes or undoes what a crash left in flight."""
