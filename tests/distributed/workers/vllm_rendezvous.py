"""Under torchrun, start a world of one the way vLLM 0.26's one-process executor does (init_process_group through a
tcp:// address on a free port), bare or inside rlx's `own_rendezvous`; prints `rendezvous <mode>: ok` or `failed`.

    torchrun --nproc_per_node 1 vllm_rendezvous.py bare|hidden
"""

import contextlib
import datetime
import os
import socket
import sys

import torch.distributed as dist

from rlx.rollout.vllm import own_rendezvous

mode = sys.argv[1]
with socket.socket() as s:  # vLLM's get_open_port
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
guard = own_rendezvous() if mode == "hidden" else contextlib.nullcontext()
try:
    with guard:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0,
                                timeout=datetime.timedelta(seconds=3))  # fmt: skip
    print(f"rendezvous {mode}: ok, agent store flag {os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}", flush=True)
    dist.destroy_process_group()
except Exception as e:  # the bare start finds no server on the port: a timeout
    print(f"rendezvous {mode}: failed ({type(e).__name__})", flush=True)
