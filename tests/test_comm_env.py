"""init_distributed on real ranks through each discovery path (torchrun, SLURM, Open MPI, AzureML, SageMaker, adopting
an existing group, nothing launched), and the errors for missing or contradictory variables."""
import os, subprocess, sys
import pytest, torch, torch.distributed as tdist
from helpers import run_distributed
from flexrt import comm as dist
from flexrt.comm.env import discover_env, DistEnv, EnvError

TORCHRUN_VARS = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'MASTER_ADDR')

def _launcher_env(kind, rank, ws):
    "The variables launcher `kind` would set for `rank` of `ws` ranks on this host (MASTER_PORT stays the harness's)"
    ompi = dict(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(ws), OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
                OMPI_COMM_WORLD_LOCAL_SIZE=str(ws))
    return {
        'slurm': dict(SLURM_PROCID=str(rank), SLURM_NTASKS=str(ws), SLURM_NPROCS=str(ws), SLURM_LOCALID=str(rank),
                      SLURM_JOB_NODELIST='localhost,gpu[07-09]', SLURM_NODELIST='localhost,gpu[07-09]', SLURM_JOB_ID='77'),
        'openmpi': ompi,
        'azureml': dict(ompi, AZUREML_EXPERIMENT_ID='exp', AZ_BATCHAI_MPI_MASTER_NODE='127.0.0.1'),
        'sagemaker': dict(ompi, SM_TRAINING_ENV='{"hosts": ["127.0.0.1"]}', SM_HOSTS='["127.0.0.1"]'),
    }[kind]

def _init_from(rank, ws, kind):
    for v in TORCHRUN_VARS: os.environ.pop(v)       # only `kind`'s variables (and the port) remain
    os.environ.update(_launcher_env(kind, rank, ws))
    env = dist.init_distributed(backend='gloo', timeout=30)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return env.source, env.rank, env.world_size, env.local_rank, os.environ['RANK'], dist.get_local_rank(), t.item()

@pytest.mark.parametrize('kind', ['slurm', 'openmpi', 'azureml', 'sagemaker'])
def test_init_from_launcher(kind):
    ws = 2
    res = run_distributed(_init_from, ws, args=(kind,), init=False)
    assert res == [(kind, r, ws, r, str(r), r, 3.0) for r in range(ws)]

def _init_torchrun(rank, ws):
    env = dist.init_distributed()
    t = torch.ones(2); dist.all_reduce(t)
    return env.source, env.rank, dist.get_backend(), t.tolist(), tdist.is_initialized()

def test_init_from_torchrun():
    assert run_distributed(_init_torchrun, 4, init=False) == [('torchrun', r, 'gloo', [4., 4.], True) for r in range(4)]

def _adopt(rank, ws):
    "accelerate / the harness created the group: init_distributed adopts it, and rejects a contradicting world size"
    pg = tdist.group.WORLD
    env = dist.init_distributed(timeout=5)
    assert tdist.group.WORLD is pg  # not re-initialised
    try: dist.init_distributed(world_size=3)
    except ValueError as e: msg = str(e)
    t = torch.ones(1); dist.all_reduce(t)
    return env.source, env.rank, t.item(), msg

def test_adopt_existing_group():
    res = run_distributed(_adopt, 2)
    assert [r[:3] for r in res] == [('adopted', 0, 2.0), ('adopted', 1, 2.0)]
    assert 'world_size=3' in res[0][3] and 'already exists has world_size 2' in res[0][3]

def _follow_torch(rank, ws):
    "With no init_distributed at all, flexrt.comm follows the group torch has (created by someone else)"
    t = torch.ones(1); dist.all_reduce(t)
    return t.item(), dist.get_comm_backend().name

def test_follows_group_created_elsewhere():
    assert run_distributed(_follow_torch, 2) == [(2.0, 'gloo')] * 2

SINGLE = r'''
import os, torch
for v in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT'): os.environ.pop(v, None)
from flexrt import comm as dist
env = dist.init_distributed()
t = torch.arange(3.); dist.all_reduce(t); out = torch.empty(3); dist.all_gather_into_tensor(out, t)
import torch.distributed as tdist
print(env.source, env.world_size, dist.get_rank(), dist.get_world_size(), dist.is_initialized(), tdist.is_initialized(), out.tolist())
dist.destroy_process_group()
os.environ['WORLD_SIZE'] = '2'; dist.all_reduce(t); print('launching parent:', dist.get_world_size())  # no RANK
os.environ['RANK'] = '1'  # a launched worker that never initialised
try: dist.all_reduce(t)
except RuntimeError as e: print('guard:', e)
'''

def test_single_process_without_process_group():
    out = subprocess.run([sys.executable, '-c', SINGLE], capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert lines[0] == 'single 1 0 1 True False [0.0, 1.0, 2.0]', out.stderr
    assert lines[1] == 'launching parent: 1'
    assert lines[2].startswith('guard: WORLD_SIZE=2 says this is one of 2 ranks, but no process group is initialised')

# ---- the variables themselves: every malformed or contradictory case names the variable ------------------------

TR = dict(RANK='1', WORLD_SIZE='2', LOCAL_RANK='1', MASTER_ADDR='h', MASTER_PORT='29400')
OM = dict(OMPI_COMM_WORLD_RANK='1', OMPI_COMM_WORLD_SIZE='4', OMPI_COMM_WORLD_LOCAL_RANK='1', OMPI_COMM_WORLD_LOCAL_SIZE='2')
SL = dict(SLURM_PROCID='1', SLURM_NTASKS='2', SLURM_LOCALID='0', SLURM_JOB_NODELIST='node[01-02]')
drop = lambda d, k: {a: b for a, b in d.items() if a != k}

@pytest.mark.parametrize('environ,kwargs,message', [
    (drop(TR, 'WORLD_SIZE'), {}, 'RANK is set but WORLD_SIZE is not'),
    (drop(TR, 'RANK'), {}, 'WORLD_SIZE is set but RANK is not'),
    ({**TR, 'RANK': 'one'}, {}, "RANK='one' is not an integer"),
    ({**TR, 'RANK': '2'}, {}, 'RANK=2 must be below WORLD_SIZE=2'),
    ({**TR, 'WORLD_SIZE': '0', 'RANK': '0'}, {}, 'WORLD_SIZE=0 must be at least 1'),
    (drop(TR, 'MASTER_ADDR'), {}, 'MASTER_ADDR is not set'),
    (drop(TR, 'MASTER_PORT'), {}, 'MASTER_PORT is not set'),
    (drop(TR, 'LOCAL_RANK'), {}, 'LOCAL_RANK is not set'),
    ({**TR, 'LOCAL_RANK': '3'}, {}, 'LOCAL_RANK=3 cannot exceed RANK=1'),
    (TR, {'rank': 0}, 'rank=0 contradicts RANK=1'),
    (TR, {'world_size': 8}, 'world_size=8 contradicts WORLD_SIZE=2'),
    (drop(OM, 'OMPI_COMM_WORLD_LOCAL_RANK'), {}, 'OMPI_COMM_WORLD_LOCAL_RANK is not set'),
    ({**OM, 'OMPI_COMM_WORLD_RANK': '9'}, {}, 'OMPI_COMM_WORLD_RANK=9 must be below OMPI_COMM_WORLD_SIZE=4'),
    ({**OM, 'MASTER_ADDR': 'h'}, {'world_size': 2}, 'world_size=2 contradicts OMPI_COMM_WORLD_SIZE=4'),
    ({**OM, 'AZUREML_EXPERIMENT_ID': 'e'}, {}, 'AZ_BATCH_MASTER_NODE is not set'),
    ({**OM, 'SM_TRAINING_ENV': '{}'}, {}, 'SM_HOSTS is not set'),
    (drop(SL, 'SLURM_JOB_NODELIST'), {}, 'SLURM_JOB_NODELIST is not set'),
    ({**SL, 'SLURM_JOB_NODELIST': 'node[02-01]'}, {}, "SLURM_JOB_NODELIST='node[02-01]': range '02-01' runs backwards"),
    ({**SL, 'SLURM_NPROCS': '3'}, {}, 'SLURM_NTASKS=2 contradicts SLURM_NPROCS=3'),
    ({**SL, 'SLURM_NODELIST': 'other'}, {}, "SLURM_JOB_NODELIST='node[01-02]' contradicts SLURM_NODELIST='other'"),
    ({**SL, 'SLURM_PROCID': '2'}, {}, 'SLURM_PROCID=2 must be below SLURM_NTASKS=2'),
    ({'MASTER_ADDR': 'h'}, {'world_size': 2}, 'no rank'),
])
def test_bad_variables_are_named(environ, kwargs, message):
    with pytest.raises(EnvError) as e: discover_env(environ, **kwargs)
    assert message in str(e.value)

def test_discovery_results():
    assert discover_env({}) == DistEnv()
    assert discover_env(SL) == DistEnv(1, 2, 0, 'node01', 29500, 'slurm')
    assert discover_env({**SL, 'SLURM_STEP_NUM_TASKS': '2', 'SLURM_NTASKS': '8', 'SLURM_NPROCS': '8'}).world_size == 2
    assert discover_env({**SL, **TR}).source == 'torchrun'  # torchrun started by srun: torchrun's view
    assert discover_env({**OM, 'MASTER_ADDR': 'n0', 'MASTER_PORT': '7'}) == DistEnv(1, 4, 1, 'n0', 7, 'openmpi')
    assert discover_env(dict(PMI_RANK='0', PMI_SIZE='2', MPI_LOCALRANKID='0', MPI_LOCALNRANKS='2')).master_addr == '127.0.0.1'
    assert discover_env({**OM, 'AZUREML_EXPERIMENT_ID': 'e', 'AZ_BATCH_MASTER_NODE': '10.0.0.5:6000'}) == \
        DistEnv(1, 4, 1, '10.0.0.5', 6105, 'azureml')
    assert discover_env({**OM, 'SM_TRAINING_ENV': '{"hosts": ["algo-2", "algo-1"]}'}).master_addr == 'algo-1'

def test_mpi_without_local_rank_variable():
    "from_mpi's own fallbacks for a missing OMPI_COMM_WORLD_LOCAL_RANK: node rank, one node, else a named error"
    base = drop(OM, 'OMPI_COMM_WORLD_LOCAL_RANK')
    assert discover_env({**base, 'OMPI_COMM_WORLD_NODE_RANK': '1', 'MASTER_ADDR': 'n0'}).local_rank == 1
    assert discover_env({**base, 'OMPI_COMM_WORLD_LOCAL_SIZE': '4'}) == DistEnv(1, 4, 1, '127.0.0.1', 29500, 'openmpi')
    assert discover_env(dict(OMPI_COMM_WORLD_RANK='0', OMPI_COMM_WORLD_SIZE='1')) == DistEnv(source='openmpi')

def test_mpi_local_rank_without_mpi4py_is_a_named_error(monkeypatch):
    "Multi-node Open MPI without a local-rank variable and without mpi4py (whether or not it is installed here)"
    monkeypatch.setitem(sys.modules, 'mpi4py', None)   # `import mpi4py` now raises ImportError
    with pytest.raises(EnvError, match='OMPI_COMM_WORLD_LOCAL_RANK is not set and mpi4py is not installed'):
        discover_env({**drop(OM, 'OMPI_COMM_WORLD_LOCAL_RANK'), 'MASTER_ADDR': 'n0'})

class _World:
    "MPI.COMM_WORLD of a 4-rank job on two hosts, seen from rank 3 (a stand-in for mpi4py, which has no MPI job here)"
    def Get_rank(self): return 3
    def allgather(self, name): return ['n0', 'n1', 'n0', 'n1']
    def bcast(self, obj, root=0): return 'n0'

def test_mpi_local_rank_from_mpi4py(monkeypatch):
    "With mpi4py: the local rank is the number of lower ranks on this host (DeepSpeed's mpi_discovery)"
    import types
    mpi = types.SimpleNamespace(COMM_WORLD=_World(), Get_processor_name=lambda: 'n1')
    monkeypatch.setitem(sys.modules, 'mpi4py', types.SimpleNamespace(MPI=mpi))
    monkeypatch.setitem(sys.modules, 'mpi4py.MPI', mpi)
    base = {**drop(OM, 'OMPI_COMM_WORLD_LOCAL_RANK'), 'OMPI_COMM_WORLD_RANK': '3'}
    assert discover_env({**base, 'MASTER_ADDR': 'n0'}).local_rank == 1   # ranks 1 and 3 share n1
    assert discover_env(base).master_addr == 'n0'                       # rank 0's host, broadcast over MPI

def _init_mpi_no_local(rank, ws):
    for v in TORCHRUN_VARS: os.environ.pop(v)
    os.environ.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(ws), OMPI_COMM_WORLD_LOCAL_SIZE=str(ws))
    env = dist.init_distributed(dist_backend='gloo', timeout=30)
    t = torch.ones(1); dist.all_reduce(t)
    return env.source, env.local_rank, t.item()

def test_init_from_mpi_without_local_rank():
    assert run_distributed(_init_mpi_no_local, 2, init=False) == [('openmpi', 0, 2.0), ('openmpi', 1, 2.0)]

def _deepspeed_keywords(rank, ws):
    out = {}
    try: dist.init_distributed(backend='gloo', dist_backend='nccl')
    except ValueError as e: out['conflict'] = str(e)
    for v in ('OMPI_COMM_WORLD_RANK',): os.environ.pop(v, None)
    env = dist.init_distributed(dist_backend='gloo', auto_mpi_discovery=False, verbose=True, timeout=30)
    out['env'] = (env.source, dist.get_backend())
    dist.configure(deepspeed_config={'comms_logger': {'enabled': True}})
    dist.all_reduce(torch.ones(4))
    d = dist.log_summary(False, True, print_table=False)
    out['summary'] = d['summary']['all_reduce'][16]['count'], sorted(d), d['metadata']['world_size'], d['metadata']['rank']
    return out

def test_deepspeed_keywords(capfd):
    for rank, out in enumerate(run_distributed(_deepspeed_keywords, 2, init=False)):
        assert "backend='gloo', dist_backend='nccl'" in out['conflict']
        assert out['env'] == ('torchrun', 'gloo')
        assert out['summary'] == (1, ['metadata', 'summary'], 2, rank)
