"""Schedule values step by step, from DeepSpeed's own `deepspeed.runtime.lr_schedules` or from flexrt's.

    python tests/ds_schedule_values.py deepspeed|flexrt cases.json values.json

Run by tests/test_ds_schedulers.py in a subprocess for DeepSpeed, so the real `deepspeed` never enters the test
process (flexrt's `use_as_deepspeed()` refuses to stand in once it is imported). Each case is
{"cls": name, "groups": [lr, ...], "optimizer": "Adam"|"SGD"|"SGDm", "kwargs": {...}, "steps": n, "jumps": [k, ...]};
the result per case is a list of records, one after construction and one after each `step()` (then one per
`step(k)` jump): the optimizer's lrs and beta1/momentum per group, `get_lr()`, and `get_mom()` for OneCycle."""
import json, sys, warnings
import torch

def optimizer(kind:str, lrs:list):
    groups = [{'params': [torch.nn.Parameter(torch.zeros(2))], 'lr': lr} for lr in lrs]
    if kind == 'Adam': return torch.optim.Adam(groups, lr=lrs[0], betas=(0.9, 0.999))
    if kind == 'SGDm': return torch.optim.SGD(groups, lr=lrs[0], momentum=0.9)
    return torch.optim.SGD(groups, lr=lrs[0])

def record(scheduler, opt)->dict:
    mom = scheduler.get_mom() if hasattr(scheduler, 'get_mom') else None
    return {'lr': [float(g['lr']) for g in opt.param_groups], 'get_lr': [float(v) for v in scheduler.get_lr()],
            'beta1': [float(g['betas'][0]) if 'betas' in g else float(g.get('momentum', 0.)) for g in opt.param_groups],
            'mom': None if mom is None else [list(m) if isinstance(m, tuple) else m for m in mom]}

def run_case(module, case:dict)->list|dict:
    "The records of one case, or {'error': exception type name} when construction raises"
    opt = optimizer(case['optimizer'], case['groups'])
    try: s = getattr(module, case['cls'])(opt, **case['kwargs'])
    except Exception as e: return {'error': type(e).__name__}
    out = [record(s, opt)]
    for _ in range(case['steps']): s.step(); out.append(record(s, opt))
    for k in case.get('jumps', []): s.step(k); out.append(record(s, opt))
    return out

def main(impl:str, cases_path:str, out_path:str):
    if impl == 'deepspeed': from deepspeed.runtime import lr_schedules as module
    else: from flexrt import schedulers as module
    with open(cases_path) as f: cases = json.load(f)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')   # both libraries warn about unknown warmup types and SGD without betas
        values = [run_case(module, c) for c in cases]
    with open(out_path, 'w') as f: json.dump(values, f)   # a file: DeepSpeed's logger writes to stdout

if __name__ == '__main__': main(*sys.argv[1:4])
