"""Can NCCL build one communicator over two ranks that share a GPU?

NCCL's device API (LSA / GIN kernels) needs an NCCL communicator across the EP ranks. On a
one-GPU machine the EP ranks share the GPU, so this probe starts two processes on device 0,
creates a torch NCCL process group bound to that device and runs one all_reduce. It prints one
``NCCL-PROBE`` line per rank: the result, or the exact error NCCL gave. Every wait is bounded.

    python tools/gpu/nccl_shared_gpu_probe.py
"""

from __future__ import annotations

import datetime
import socket
import sys
import traceback

import torch
import torch.multiprocessing as mp

TIMEOUT_S = 60


def _rank(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    try:
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=dev,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
        t = torch.full((4,), float(rank + 1), device=dev)
        dist.all_reduce(t)
        torch.cuda.synchronize()
        print(f"NCCL-PROBE rank={rank}: communicator up, all_reduce -> {t.tolist()} (NCCL {torch.cuda.nccl.version()})",
              flush=True)
        dist.destroy_process_group()
    except Exception as e:
        last = traceback.format_exc().strip().splitlines()[-1]
        print(f"NCCL-PROBE rank={rank}: FAILED {type(e).__name__}: {last}", flush=True)
        sys.exit(1)


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, 2, port)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S + 15)
        if p.is_alive():
            print(f"NCCL-PROBE pid={p.pid}: no result within {TIMEOUT_S + 15} s, killed", flush=True)
            p.kill()
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
