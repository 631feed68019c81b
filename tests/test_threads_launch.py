"""Each rank runs `max(1, cores // ranks)` torch threads however it is launched, unless the user chose: under
`flexrt.launch` from its first line, under plain `notebook_launcher` from `flexrt.initialize` on, and under torchrun
too (the `OMP_NUM_THREADS=1` torchrun sets when the variable is unset is torchrun's, not the user's; one given to
torchrun is kept). A user's oversubscribing `OMP_NUM_THREADS` is kept and
warned about once, in the launching cell; the engine's 'run' record carries the plan."""
import json, os, signal, subprocess, sys
from pathlib import Path
import nbformat, pytest, torch
from nbclient import NotebookClient
from flexrt import monitor
from flexrt.launch import launch, free_port, describe_launch
from flexrt.utils.threads import ThreadPlan, available_cores

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from launch_threads_train import threads_seen, train_steps, train_steps_into
from helpers import run_torchrun

CORES = available_cores()
SIZED = max(1, CORES // 2)   # two ranks on this machine

@pytest.fixture
def no_omp(monkeypatch):
    "The kernel's environment without OMP_NUM_THREADS (restored after the test)"
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)

def _written(out_dir:Path)->list: return [json.loads(p.read_text()) for p in sorted(out_dir.glob('rank*.json'))]

def test_flexrt_launch_sizes_each_rank_before_the_function_runs(no_omp):
    run = launch(threads_seen, num_processes=2)                      # no flexrt.initialize in the rank
    assert [(r['threads'], r['omp']) for r in run.results] == [(SIZED, None)] * 2

def test_the_run_record_carries_the_thread_plan(no_omp):
    runs = []
    with monitor.listen(lambda r: r['kind'] == 'run' and runs.append(r)):
        run = launch(train_steps, (2,), num_processes=2)
    plan = {'threads': SIZED, 'local_ranks': 2, 'cores': CORES, 'source': 'sized', 'oversubscribed': False}
    assert [r['threads'] for r in runs] == [plan]                    # rank 0's one 'run' record
    assert [r['plan'] for r in run.results] == [plan, plan]
    assert [r['after']['threads'] for r in run.results] == [SIZED, SIZED]

def test_plain_notebook_launcher_ranks_are_sized_by_flexrt_initialize(tmp_path, no_omp):
    from accelerate import notebook_launcher
    kernels = torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}   # the launcher replaces them
    try: notebook_launcher(train_steps_into, (str(tmp_path),), num_processes=2, use_port=str(free_port()))
    finally:
        for s, h in handlers.items(): signal.signal(s, h)
    seen = _written(tmp_path)
    # notebook_launcher sets no thread count and no OMP_NUM_THREADS: a forked rank runs the kernel's count ...
    assert [(s['before']['threads'], s['before']['omp']) for s in seen] == [(kernels, None)] * 2
    assert [(s['after']['threads'], s['plan']['source']) for s in seen] == [(SIZED, 'sized')] * 2   # ... till then

def test_torchrun_ranks_are_sized_and_an_omp_num_threads_given_to_torchrun_is_kept(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != 'OMP_NUM_THREADS'}
    for given in (None, '1'):
        out = tmp_path / f'omp{given}'
        out.mkdir()
        cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', str(free_port()),
               str(HERE / 'launch_threads_train.py'), str(out)]
        done = run_torchrun(cmd, env=env | ({'OMP_NUM_THREADS': given} if given else {}), capture_output=True, text=True,
                            timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        seen = _written(out)
        assert [(s['before']['threads'], s['before']['omp']) for s in seen] == [(1, '1')] * 2   # torchrun's 1, or yours
        if given is None:   # torchrun put it there (it says so): flexrt sizes the ranks
            assert 'Setting OMP_NUM_THREADS environment variable for each process to be 1' in done.stderr
            assert [(s['after']['threads'], s['plan']['source']) for s in seen] == [(SIZED, 'sized')] * 2
        else:
            assert [(s['after']['threads'], s['plan']['source']) for s in seen] == [(1, 'OMP_NUM_THREADS')] * 2
        assert 'UserWarning' not in done.stderr                      # 1 thread per rank oversubscribes nothing

def _run_cells(cells:list)->nbformat.NotebookNode:
    "Run `cells` in a fresh Jupyter kernel started in tests/ (what a notebook user sees)"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=120, kernel_name='python3', resources={'metadata': {'path': str(HERE)}}).execute()
    return nb

def test_users_omp_num_threads_is_kept_and_warned_about_once_in_the_launching_cell():
    omp = CORES          # 2 ranks × all cores each oversubscribes any machine (2 on a 2-core one)
    nb = _run_cells([f"import os; os.environ['OMP_NUM_THREADS'] = '{omp}'   # the user's choice, in the kernel",
                     "import json, flexrt\nfrom launch_threads_train import train_steps\n"
                     "run = flexrt.launch(train_steps, (2,), num_processes=2)",
                     "print(json.dumps(run.results))"])
    launching = nb.cells[1].outputs
    said = [o['text'] for o in launching if o.get('name') == 'stdout']
    assert said == [describe_launch(2, ThreadPlan(omp, 2, CORES, 'OMP_NUM_THREADS')) + '\n']
    assert said[0].endswith(f'2 ranks × {omp} threads on {CORES} cores (OMP_NUM_THREADS, oversubscribed)\n') or \
           torch.cuda.is_available()                                 # (on a GPU machine: '... CPU threads ...')
    warned = ''.join(o['text'] for o in launching if o.get('name') == 'stderr')   # the ranks' stderr reaches the cell
    warning = f'2 ranks × {omp} threads on {CORES} cores (OMP_NUM_THREADS={omp}): {2 * omp} compute threads take turns'
    assert warned.count(warning) == 1, warned                       # once: rank 0, and not again from initialize
    assert f'unset OMP_NUM_THREADS and flexrt gives each rank {SIZED}' in warned
    results = json.loads(nb.cells[2].outputs[0]['text'])
    assert [(r['before']['threads'], r['after']['threads'], r['plan']['source']) for r in results] == \
           [(omp, omp, 'OMP_NUM_THREADS')] * 2                       # kept, before and after flexrt.initialize

@pytest.mark.skipif(CORES < 2, reason="torch's default count is 1 here: a user's 1 cannot be told from it")
def test_users_omp_num_threads_set_in_the_kernel_after_it_started_is_what_ranks_run(monkeypatch):
    monkeypatch.setenv('OMP_NUM_THREADS', '1')                       # torch in this process started without it
    run = launch(threads_seen, num_processes=2)
    assert [r['threads'] for r in run.results] == [1, 1]
