"""Real DeepSpeed in the tests' processes, set up in one place: the CPU accelerator (unless one is set), and no
shared-memory comm op.

DeepSpeed's CPU backend JIT-compiles a shared-memory op that only `inference_all_reduce` uses (training collectives go
through gloo). The build takes minutes on a loaded machine, and its lock file in the torch extension cache is shared
with every other DeepSpeed process of the user (other test sessions clean that cache up), so a build can stall or
break a job. The op is marked unavailable, which DeepSpeed itself handles: there is no op, and gloo reduces.

    from real_deepspeed import import_deepspeed     # in a script or a rank of the tests (tests/ is on sys.path)
    deepspeed = import_deepspeed()

    python tests/real_deepspeed.py SCRIPT ARGS...    # an unmodified DeepSpeed script, under torchrun too
"""
import logging, os, runpy, sys

SHM_COMM_OP = 'deepspeed_shm_comm'   # the name of DeepSpeed's ShareMemCommBuilder

def import_deepspeed(quiet:bool=True):
    "`import deepspeed` on the CPU accelerator (unless DS_ACCELERATOR says otherwise) without its shared-memory op; `quiet`: its logger at errors only"
    os.environ.setdefault('DS_ACCELERATOR', 'cpu')
    import deepspeed
    if quiet: deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
    return deepspeed

if __name__ == '__main__':   # run SCRIPT as `python SCRIPT ARGS...` would, after the set-up above
    script = os.path.abspath(sys.argv[1])
    import_deepspeed(quiet=False)
    sys.argv, sys.path[0] = sys.argv[1:], os.path.dirname(script)
    try:
        runpy.run_path(script, run_name='__main__')
    finally:
        # DeepSpeed leaves its process group to interpreter finalisation, where gloo's threads can abort the rank
        # (SIGABRT, "terminate called without an active exception": both tries of a reference run under load). The
        # tests compare what the script computed, written by now; bench/exit_abort.py measures DeepSpeed's exit.
        import torch.distributed as tdist
        if tdist.is_available() and tdist.is_initialized(): tdist.destroy_process_group()
