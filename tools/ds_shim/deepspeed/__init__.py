"""Put first on PYTHONPATH by tools/ds_tests.py: `import deepspeed` in any process (pytest and the ranks DeepSpeed's test
harness starts) gives flexrt's module tree (`flexrt.deepspeed.use_as_deepspeed()`), never an installed DeepSpeed."""
import sys
del sys.modules['deepspeed']   # this placeholder; flexrt's tree takes its place
import flexrt.deepspeed
sys.modules['deepspeed'] = flexrt.deepspeed.use_as_deepspeed()
