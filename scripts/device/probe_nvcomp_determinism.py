#!/usr/bin/env python3
"""Is nvCOMP's output deterministic? Encode the same device bytes twice per algorithm and bitstream
kind, and report where the outputs differ (this decides how chunk ids and zero detection work)."""
import os

import numpy as np
import torch
from nvidia import nvcomp
from storage.device import DeviceBytes

n = 64 << 20
g = torch.Generator(device="cuda").manual_seed(1)
data = {"zeros": torch.zeros(n, dtype=torch.uint8, device="cuda"),
        "bf16": (torch.randn(n // 2, generator=g, device="cuda") * 0.02).to(torch.bfloat16).view(torch.uint8)}
s = torch.cuda.Stream()
for algo in ("ANS", "Bitcomp", "LZ4"):
    for kind in ("NVCOMP_NATIVE",):
        for name, t in data.items():
            outs = []
            try:
                for _ in range(3):
                    c = nvcomp.Codec(algorithm=algo, uncomp_chunk_size=64 << 10, cuda_stream=s.cuda_stream,
                                     bitstream_kind=getattr(nvcomp.BitstreamKind, kind))
                    if os.environ.get("ZERO_OUT"):
                        ob = torch.zeros(n * 3 // 2 + (4 << 20), dtype=torch.uint8, device="cuda")
                        torch.cuda.synchronize()
                        e = c.encode(nvcomp.as_array(DeviceBytes(t.data_ptr(), n)),
                                     out=nvcomp.as_array(DeviceBytes(ob.data_ptr(), ob.numel())))
                    else:
                        e = c.encode(nvcomp.as_array(DeviceBytes(t.data_ptr(), n)))
                    outs.append(np.asarray(e.cpu()).view(np.uint8).tobytes())
                m = min(len(outs[0]), len(outs[1]))
                a0, a1 = np.frombuffer(outs[0][:m], np.uint8), np.frombuffer(outs[1][:m], np.uint8)
                diff = np.nonzero(a0 != a1)[0].tolist()
                print(f"{algo:8} {kind:14} {name:6} sizes {[len(o) for o in outs]} same={outs[0]==outs[1]==outs[2]} "
                      f"ndiff={len(diff)} first={diff[:5]}")
            except Exception as ex:
                print(f"{algo:8} {kind:14} {name:6} ERROR {type(ex).__name__}: {ex}")
