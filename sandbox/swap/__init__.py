"""`gpusnap swap`: one daemon fronting several model servers that share a GPU, swapping them out and in
as requests arrive (issue 57).

The parts, each in its module, from the bottom: config (the TOML file, validated into frozen
dataclasses), policy (which resident servers to swap out: pure), registry (each server's state and
figures), http (HTTP/1.1 message framing over asyncio streams: bytes passed through, never rewritten
but for a routing prefix), swapper (start, swap out, swap in: the journaled gpusnap operations
`criu dump`/`criu restore` or `gpu checkpoint`/`gpu restore`), control (the root-only control socket,
`swap status` and /metrics), proxy (routing and forwarding), daemon (the event loop that ties them).
This floor sits above criu/ and gpu/, whose operations it runs.
"""
