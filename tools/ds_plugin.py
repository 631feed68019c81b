"""pytest plugin loaded with `-p ds_plugin` by tools/ds_tests.py: flexrt takes DeepSpeed's place before anything is collected."""
import os
os.environ.setdefault('DS_ACCELERATOR', 'cpu')
import flexrt.deepspeed
flexrt.deepspeed.use_as_deepspeed()
