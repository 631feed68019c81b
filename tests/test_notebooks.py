"""examples/quickstart.ipynb in a real kernel (nbclient): a 2-rank engine run under flexrt.launch delivers
every step record to the dashboard before the launching cell ends (the cell's output says what started, no warnings); checked in the kernel (the notebook's own
asserts), in the saved widget state, and in the files `make demo` writes."""
import contextlib, re, socket, sys
from pathlib import Path
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'examples'))
from run_quickstart import run
from flexrt.utils.threads import ThreadPlan, available_cores
from flexrt.launch import describe_launch

STEPS = 6

def _models(nb):
    state = nb.metadata['widgets']['application/vnd.jupyter.widget-state+json']['state']
    return [m for m in state.values()]

@contextlib.contextmanager
def _port_taken(port=29500):
    "Hold `port` (notebook_launcher's default) as another notebook's run would; yield whether it was free to take"
    with socket.socket() as s:
        try: s.bind(('127.0.0.1', port)); s.listen()
        except OSError: yield False; return
        yield True

def test_quickstart_delivers_every_step_before_the_launch_cell_ends(tmp_path):
    with _port_taken():                                              # the quickstart must not need port 29500
        nb = run(tmp_path, STEPS)                                    # raises if any cell (the asserts) failed
    cores = available_cores()
    sized = ThreadPlan(max(1, cores // 2), 2, cores, 'sized')
    launch_cell = next(c for c in nb.cells if c.cell_type == 'code' and 'launch(train' in c.source)
    printed = [o for o in launch_cell.outputs if o.get('output_type') == 'stream']
    assert [(o['name'], o['text'].strip()) for o in printed] == [('stdout', describe_launch(2, sized))]
    # each rank sized to the machine: '...: 2 ranks × 1 thread on 2 cores' here
    after = nb.cells[nb.cells.index(launch_cell) + 2]                # the first cell after the launch, in the kernel
    assert f'{2 * STEPS} step records' in ''.join(o.get('text', '') for o in after.outputs)
    models = _models(nb)
    counters = [m['state'] for m in models if m['model_name'] == 'IntTextModel']
    assert [c['value'] for c in counters] == [2 * STEPS]             # the saved widget state agrees
    bars = [m['state'] for m in models if m['model_name'] == 'IntProgressModel']
    assert [(b['value'], b['max']) for b in bars] == [(STEPS, STEPS)]
    plots = [m['state']['value'] for m in models if m['model_name'] == 'HTMLModel']
    figures = [p for p in plots if p.startswith('<img src="data:image/png')]
    assert len(figures) == 4, len(figures)   # grad-norm, ranks, step anatomy and memory (layer norms every 10 steps: none in 6)
    texts = ' '.join(m['state'].get('value', '') for m in models if m['model_name'] == 'HTMLModel')
    assert re.search(r'rank [01]: ', texts) or 'ranks even' in texts, 'the ranks panel names the busiest rank'
    steps = pd.read_csv(tmp_path / 'history.csv')                     # the step records
    assert set(steps['kind']) == {'step'}
    for rank in (0, 1): assert list(steps[steps['rank'] == rank]['step']) == list(range(1, STEPS + 1))
    assert (steps['grad_norm'] > 0).all() and (steps['memory.allocated_bytes'] > 0).all()
    samples = pd.read_csv(tmp_path / 'memory.csv')                   # the ranks' samplers, between the steps
    assert set(samples['rank']) == {0, 1} and (samples['memory.allocated_bytes'] > 0).all()
    assert {'grad_norm.png', 'memory.png', 'quickstart.ipynb'} <= {p.name for p in tmp_path.iterdir()}
