"""The package's seams, read from its source with `ast`: import circles, imports that run back up into a package's
face, names imported through another package's face instead of their defining module, imports that point up a layer
(a notebook with a higher `NN_` imported by a lower one), private names imported across modules or read from them,
methods patched onto a class from another module, in-package code that reaches a name through `flexrt/__init__`'s
lazy loading, and the loose modules at the top level. And how the code reads
(STYLE.md 11 and 13): the share of methods attached with `@patch` (under 20 %, and at least two thirds of each of the 15
largest classes' methods in its body), attributes first set outside `__init__`, lines over 120 characters and
`;`-joined statements (lines nbdev writes, the module docstring and `__all__`, aside), and a public name defined in two
modules (DeepSpeed's mirrored surface aside).

`python tools/import_graph.py` prints what it finds and exits 1 if anything breaks the rules (tests/test_project.py
runs it); `--graph` also prints every module's in-package imports.
"""
import ast, collections, io, json, sys, tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_TOP_LEVEL = 8   # loose modules beside the packages
MAX_PATCH_SHARE = 0.2   # of all methods, those attached with @patch
MIN_BODY_SHARE = 2 / 3   # of each large class's methods, those in its body
LARGEST = 15   # the classes held to MIN_BODY_SHARE, by method count
MAX_LINE = 120
INIT_METHODS = ('__init__', '__post_init__', '__new__', '__setstate__')

def module_name(path, root):
    parts = path.relative_to(root.parent).with_suffix('').parts
    return '.'.join(parts[:-1] if path.name == '__init__.py' else parts)

def parse(root):
    "{module: (path, tree)} for every source file of the package"
    return {module_name(p, root): (p, ast.parse(p.read_text())) for p in sorted(root.rglob('*.py'))
            if p.name != '_modidx.py' and '__pycache__' not in p.parts}

def resolve(node, module, is_package):
    "The absolute module an `ImportFrom` names"
    if not node.level: return node.module or ''
    package = module if is_package else module.rsplit('.', 1)[0]
    base = package.split('.')[:len(package.split('.')) - node.level + 1]
    return '.'.join(base + ([node.module] if node.module else []))

def imports(mods):
    "[(importer, imported module, names)] for every in-package import, `from x import y` resolving y to x.y if a module"
    out = []
    for m, (p, tree) in mods.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = resolve(node, m, p.name == '__init__.py')
                for a in node.names:
                    target = f'{base}.{a.name}' if f'{base}.{a.name}' in mods else base
                    if target in mods and target != m: out.append((m, target, a.name if target == base else None))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods and a.name != m: out.append((m, a.name, None))
    return out

def circles(edges):
    "Strongly connected components of more than one module (Tarjan)"
    index, low, stack, on, found = {}, {}, [], set(), []
    def visit(v):
        index[v] = low[v] = len(index); stack.append(v); on.add(v)
        for w in edges.get(v, ()):
            if w not in index: visit(w); low[v] = min(low[v], low[w])
            elif w in on: low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v: break
            if len(comp) > 1: found.append(sorted(comp))
    sys.setrecursionlimit(10000)
    for v in list(edges): 
        if v not in index: visit(v)
    return found

def patched_from_elsewhere(mods):
    "Methods `@patch`ed onto a class of the package from a module other than the class's own"
    defined = collections.defaultdict(set)   # class name -> the modules defining a class of that name
    for m, (_, tree) in mods.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef): defined[node.name].add(m)
    out = []
    for m, (_, tree) in mods.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or not node.args.args: continue
            if not any(ast.unparse(d).split('(')[0] in ('patch', 'fastcore.basics.patch') for d in node.decorator_list): continue
            ann = node.args.args[0].annotation
            if ann is None: continue
            for cls in (c.strip().split('.')[-1] for c in ast.unparse(ann).split('|')):
                if cls in defined and m not in defined[cls]:
                    out.append(f'{m}: {node.name} patched onto {cls} ({", ".join(sorted(defined[cls]))})')
    return out

def through_the_face(mods):
    "In-package code that reads `flexrt.<name>` (resolved by the top-level lazy `__getattr__`) instead of importing it"
    out = []
    for m, (_, tree) in mods.items():
        if m == 'flexrt': continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == 'flexrt'):
                out.append(f'{m}: flexrt.{node.attr}')
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ('importlib.import_module', 'import_module'):
                arg = node.args[0] if node.args else None
                if isinstance(arg, ast.Constant) and arg.value == 'flexrt': out.append(f'{m}: import_module("flexrt")')
    return out

def private_attributes(mods):
    "`module._name` where `module` is an in-package module imported under that name"
    out = []
    for m, (p, tree) in mods.items():
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or '').startswith('flexrt')):
                base = resolve(node, m, p.name == '__init__.py')
                aliases |= {a.asname or a.name for a in node.names if f'{base}.{a.name}' in mods}
            elif isinstance(node, ast.Import):
                aliases |= {(a.asname or a.name).split('.')[0] for a in node.names if a.name in mods}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith('_') and not node.attr.startswith('__')):
                out.append(f'{m}:{node.lineno} reads {node.value.id}.{node.attr}')
    return sorted(set(out))

def _is_patch(decorator)->bool:
    return ast.unparse(decorator).split('(')[0] in ('patch', 'patch_to', 'fastcore.basics.patch')

def method_placement(mods)->dict: # class name -> [methods in its body, methods patched onto it]
    "How many methods each class has in its body and how many are attached with `@patch` / `@patch_to`"
    counts = collections.defaultdict(lambda: [0, 0])
    for _, tree in mods.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                counts[node.name][0] += sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(map(_is_patch, node.decorator_list)):
                target = next((d for d in node.decorator_list if _is_patch(d)), None)
                if isinstance(target, ast.Call) and target.args: cls = ast.unparse(target.args[0])
                elif node.args.args and node.args.args[0].annotation is not None:
                    cls = ast.unparse(node.args.args[0].annotation)
                else: continue
                counts[cls.split('.')[-1]][1] += 1
    return dict(counts)

def patch_problems(mods)->list:
    "The patch share over MAX_PATCH_SHARE, and large classes with less than MIN_BODY_SHARE of their methods in the body"
    counts = method_placement(mods)
    body, patched = sum(b for b, _ in counts.values()), sum(p for _, p in counts.values())
    out = []
    if patched > MAX_PATCH_SHARE * (body + patched):
        out.append(f'{patched} of {body + patched} methods are patched ({patched / (body + patched):.0%}; at most '
                   f'{MAX_PATCH_SHARE:.0%}): move them into their class body')
    for name, (b, p) in sorted(counts.items(), key=lambda kv: -sum(kv[1]))[:LARGEST]:
        if b < MIN_BODY_SHARE * (b + p): out.append(f'{name}: {b} of {b + p} methods in its body (at least 2/3)')
    return out

def _assigned(targets):
    "The expressions an assignment binds: unpacked tuples and lists, not the objects an attribute is set on"
    for t in targets:
        if isinstance(t, (ast.Tuple, ast.List)): yield from _assigned(t.elts)
        elif isinstance(t, ast.Starred): yield from _assigned([t.value])
        else: yield t

def late_attributes(mods)->list:
    "Attributes a method sets on `self` that `__init__` (or the class body) does not: a reader of `__init__` misses them"
    out = []
    for m, (_, tree) in mods.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            declared = {t.id for n in cls.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                        for target in (n.targets if isinstance(n, ast.Assign) else [n.target])
                        for t in ast.walk(target) if isinstance(t, ast.Name)}
            declared |= {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            in_init, later = set(), collections.defaultdict(set)
            for f in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
                for node in ast.walk(f):
                    if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)): continue
                    for t in _assigned(node.targets if isinstance(node, ast.Assign) else [node.target]):
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == 'self':
                            (in_init.add(t.attr) if f.name in INIT_METHODS else later[t.attr].add(f.name))
            out += [f'{m}: {cls.name}.{a} (first set in {", ".join(sorted(fs))})'
                    for a, fs in sorted(later.items()) if a not in in_init and a not in declared]
    return out

def generated_lines(tree)->set:
    "Line numbers nbdev writes itself: the module docstring (from the notebook's summary) and `__all__`"
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out |= set(range(node.lineno, node.end_lineno + 1)); break
    return out | {n.lineno for n in tree.body if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == '__all__' for t in n.targets)}

def line_problems(mods)->tuple: # (lines over MAX_LINE, `;`-joined statements)
    "Lines over MAX_LINE characters and statements joined by `;`, as `module:line`"
    long, joined = [], []
    for m, (p, tree) in mods.items():
        text, skip = p.read_text(), generated_lines(tree)
        long += [f'{m}:{i} ({len(line)} characters)' for i, line in enumerate(text.split('\n'), 1)
                 if len(line) > MAX_LINE and i not in skip]
        joined += [f'{m}:{t.start[0]}' for t in tokenize.generate_tokens(io.StringIO(text).readline)
                   if t.type == tokenize.OP and t.string == ';']
    return long, joined

SURFACES = ('flexrt.deepspeed', 'flexrt.checkpointing')   # DeepSpeed's names, mirrored on purpose

def name_collisions(mods)->list:
    "Public top-level names (classes, functions, CONSTANTS) defined in more than one module: one name per concept"
    where = collections.defaultdict(list)
    for m, (p, tree) in mods.items():
        if p.name == '__init__.py' or m.startswith(SURFACES): continue
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)): names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name) and t.id.isupper()]
            else: names = []
            for name in names:
                if not name.startswith('_') and name != 'main': where[name].append(m)
    return [f'{name}: {", ".join(sorted(set(ms)))}' for name, ms in sorted(where.items()) if len(set(ms)) > 1]

def layers(root):
    "{module: NN} from each notebook's name `NN_...` and its `#| default_exp` (the layer the module sits in)"
    out = {}
    for nb in sorted(root.parent.glob('nbs/[0-9]*.ipynb')):
        for cell in json.loads(nb.read_text())['cells'][:3]:
            text = ''.join(cell['source'])
            if text.startswith('#| default_exp'):
                name = text.split()[2].removesuffix('.__init__')
                out['flexrt' if name == '__init__' else f'flexrt.{name}'] = int(nb.name.split('_')[0])
    return out

def report(root=ROOT / 'flexrt', show_graph=False):
    mods = parse(root)
    edges, problems = collections.defaultdict(set), collections.defaultdict(list)
    for importer, target, name in imports(mods):
        edges[importer].add(target)
        if name and name.startswith('_') and not name.startswith('__'):
            problems['private names imported across modules'].append(f'{importer} takes {name} from {target}')
        is_package = mods[importer][0].name in ('__init__.py', '__main__.py')   # a face, or a package's script
        # back up: a module importing the face of a package that contains it (the face imports its members)
        if not is_package and importer.startswith(target + '.') and target != 'flexrt':
            problems['imports that run back up into a package face'].append(f'{importer} imports {target}')
        if not is_package and target == 'flexrt' and name != '__version__':
            problems['imports that run back up into a package face'].append(f'{importer} imports flexrt')
        # a name taken from another wing's face: the reader is sent to the face, not to the definition
        if (not is_package and name and target != 'flexrt' and mods[target][0].name == '__init__.py'
                and not importer.startswith(target + '.')):
            problems['names imported through a package face, not from their defining module'].append(
                f'{importer} takes {name} from {target}')
    for c in circles(edges): problems['import circles'].append(' <-> '.join(c))
    layer, up = layers(root), 'imports that point up a layer (to a higher notebook number)'
    for importer, targets in sorted(edges.items()):
        for target in sorted(targets):
            if (importer in layer and target in layer and layer[target] > layer[importer] and target != 'flexrt'
                    and not target.startswith(importer + '.')):   # a face hands on its own sub-wings
                problems[up].append(f'{importer} ({layer[importer]:02d}) imports {target} ({layer[target]:02d})')
    problems['private names read from another module'] += private_attributes(mods)
    problems['methods patched from another module'] += patched_from_elsewhere(mods)
    problems['names reached through flexrt/__init__'] += through_the_face(mods)
    problems['methods attached with @patch'] += patch_problems(mods)
    problems['attributes first set outside __init__'] += late_attributes(mods)
    long, joined = line_problems(mods)
    problems[f'lines over {MAX_LINE} characters'] += long
    problems['statements joined by ;'] += joined
    problems['one name for two things (defined in more than one module)'] += name_collisions(mods)
    loose = sorted(m for m, (p, _) in mods.items() if m.count('.') == 1 and p.name != '__init__.py')
    if len(loose) > MAX_TOP_LEVEL:
        problems[f'more than {MAX_TOP_LEVEL} loose top-level modules'].append(', '.join(loose))
    print(f'{len(mods)} modules, {sum(map(len, edges.values()))} in-package imports; '
          f'{len(loose)} loose top-level modules: {", ".join(m.split(".", 1)[1] for m in loose)}')
    if show_graph:
        for m in sorted(edges): print(f'  {m} -> {", ".join(sorted(edges[m]))}')
    for title, rows in problems.items():
        if rows: print(f'\n{title} ({len(rows)}):\n' + '\n'.join(f'  {r}' for r in rows))
    return 1 if any(problems.values()) else 0

if __name__ == '__main__':
    sys.exit(report(show_graph='--graph' in sys.argv))
