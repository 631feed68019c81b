"""What a notebook does to train with Accelerate's DeepSpeed plugin on flexrt: one `flexrt.use_as_deepspeed()` line in
the kernel, then `notebook_launcher` forks the ranks, which inherit the alias. The training function is the Accelerate
loop of hf_accelerate_train.py (importable, so it survives fork and spawn alike); tests/test_hf_clients.py compares
its results with the same loop run under torchrun on real DeepSpeed.

    python hf_notebook_launch.py STAGE OUT.json
"""
import sys
import flexrt
flexrt.use_as_deepspeed()                       # the one line: before anything imports deepspeed (or accelerate)
from accelerate import notebook_launcher
from hf_accelerate_train import train

if __name__ == '__main__':
    notebook_launcher(train, args=(int(sys.argv[1]), 8, sys.argv[2]), num_processes=2)
