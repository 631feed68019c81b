"bench/step_timeline.py on 2 real gloo ranks with a tiny MLP: the timeline's structure, not its timings"
import importlib.util, io, json, pathlib
import pytest
from helpers import run_distributed

_path = pathlib.Path(__file__).parent.parent / 'bench' / 'step_timeline.py'
_spec = importlib.util.spec_from_file_location('step_timeline', _path)
st = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(st)

PHASES = ['forward', 'backward', 'allreduce', 'step']
EPS = 1e-6   # ms: sums of the same floats taken in another order

def _check_step(step, raw, window):
    items = step['intervals']
    starts = [i['start_ms'] for i in items]
    assert starts == sorted(starts), 'intervals in order of start'
    assert [i['name'] for i in items if i['kind'] == 'phase'] == PHASES
    tiles = sum(i['end_ms'] - i['start_ms'] for i in items if i['kind'] != 'comm')
    assert tiles == pytest.approx(step['total']['step_ms'], abs=1e-3), 'phases and the gaps between them make the step'
    ops = [i for i in items if i['kind'] == 'comm']
    for o in ops:
        assert 0 <= o['start_ms'] <= o['end_ms'] <= step['total']['step_ms'] + EPS
        assert o['blocked_ms'] >= 0 and o['overlapped_ms'] >= -EPS
        assert o['blocked_ms'] + o['overlapped_ms'] == pytest.approx(o['in_flight_ms'], abs=EPS)
        if o['finished_by'] == 'call': assert o['overlapped_ms'] == pytest.approx(0, abs=EPS), 'a synchronous op blocks its caller'
    for name, s in step['ops'].items():
        mine = [o for o in ops if o['name'] == name]
        assert s['count'] == len(mine) and s['bytes'] == sum(o['size'] for o in mine)
        assert s['blocked_ms'] + s['overlapped_ms'] == pytest.approx(s['comm_ms'], abs=EPS)
    t = step['total']
    assert t['compute_ms'] + t['blocked_ms'] == pytest.approx(t['step_ms'], abs=EPS)
    assert t['overlapped_ms'] + t['blocked_ms'] - t['wake_ms'] == pytest.approx(t['comm_ms'], abs=EPS)
    assert t['wake_ms'] >= -EPS and t['overlapped_ms'] >= -EPS
    assert all(o['wait_span'] for o in ops if o['finished_by'] == 'call'), 'a synchronous op is waited for by its caller'
    assert sum(p['blocked_ms'] for p in step['phases'].values()) == pytest.approx(t['blocked_ms'], abs=1e-3), 'waits lie in phases or gaps'
    assert t['comm_ms'] <= sum(s['comm_ms'] for s in step['ops'].values()) + EPS
    issued_inside = {r['index'] for r in raw['comms'] if window[0] <= r['issued'] <= window[1]}
    assert issued_inside <= {o['index'] for o in ops}, 'every op issued during the step is in its timeline'
    return ops

@pytest.mark.parametrize('stage', [2, 3])
def test_timeline_structure(stage, tmp_path):
    # width 320: 102,720 parameters per layer, above stage 3's persistence threshold, so forward gathers them
    args = st.workload(stage=stage, mlp_width=320, mlp_layers=2, mlp_batch=2, steps=3, warmup=1)
    ranks = run_distributed(st.measure, world_size=2, args=(args,), timeout=180)
    for raw in ranks:
        assert raw['logged_calls'] == len(raw['comms']) > 0, "the timeline holds every call the comms logger counted"
        assert all(r['end'] is not None and r['issued'] <= r['end'] for r in raw['comms'])
        w = raw['windows']
        assert all(any(a <= r['issued'] <= b for a, b in w) for r in raw['comms'] if r['issued'] >= w[0][0]), \
            'no op issued between the measured steps: each step window holds all its communication'
        steps = st.analyse(raw)
        assert len(steps) == args.steps
        ops = [o for step, w in zip(steps, raw['windows']) for o in _check_step(step, raw, w)]
        names = {o['op'] for o in ops}
        assert any('reduce' in n for n in names) and any('gather' in n for n in names), names
        if stage == 3:
            fwd = [next(i for i in s['intervals'] if i['name'] == 'forward') for s in steps]
            assert all(any('gather' in o['op'] and o['start_ms'] < f['end_ms'] and o['end_ms'] > f['start_ms']
                           for o in s['intervals'] if o['kind'] == 'comm') for s, f in zip(steps, fwd)), 'stage 3 gathers in forward'
    out = io.StringIO()
    st.report(args, ranks, file=out)
    text = out.getvalue()
    for word in PHASES + ['step', 'compute', 'blocked in communication', 'waking up', 'overlapped', 'median over 3 steps']: assert word in text
    st.write_trace(tmp_path / 't.json', args, ranks)
    trace = json.loads((tmp_path / 't.json').read_text())
    events = [e for e in trace['traceEvents'] if e['ph'] == 'X']
    assert {e['pid'] for e in events} == {0, 1}
    for rank, steps in enumerate(trace['flexrtSteps']):
        n_ops = sum(i['kind'] == 'comm' for s in steps for i in s['intervals'])
        assert sum(e['pid'] == rank and e['tid'] > 0 for e in events) == n_ops, 'each op in flight is one event on a comm lane'
        thread = sorted((e for e in events if e['pid'] == rank and e['tid'] == 0), key=lambda e: (e['ts'], -e['dur']))
        stack = []
        for e in thread:   # steps hold phases, phases hold waits: events on the training thread's track nest
            while stack and stack[-1] <= e['ts'] + 1e-3: stack.pop()
            assert not stack or e['ts'] + e['dur'] <= stack[-1] + 1e-3, e
            stack.append(e['ts'] + e['dur'])
        lanes = {}
        for e in sorted((e for e in events if e['pid'] == rank and e['tid'] > 0), key=lambda e: e['ts']):
            assert e['ts'] >= lanes.get(e['tid'], -1) - 1e-3, 'ops on one lane do not overlap'
            lanes[e['tid']] = e['ts'] + e['dur']

def test_union_and_overlap():
    test = st.union([(0, 2), (1, 3), (5, 6), (4, 4)])
    assert test == [[0, 3], [5, 6]]
    assert st.length([(0, 2), (1, 3)]) == 3
    assert st.overlap([(0, 3)], [(1, 2), (2.5, 5)]) == pytest.approx(1.5)
    assert st.lanes([(0, 2), (1, 3), (2, 4)]) == [0, 1, 0]
