"""gpusnap agents: programs gpusnap runs inside a workload's sandbox (the gVisor GPU agent, through
`runsc exec`). They see only their own sandbox and talk to the host over a channel, never to the store."""
