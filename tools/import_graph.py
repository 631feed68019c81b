"""The package's seams, read from its source with `ast`: import circles, imports that run back up into a package's
face, imports that point up a layer (a notebook with a higher `NN_` imported by a lower one), private names imported
across modules or read from them, methods patched onto a class from another module, in-package code that
reaches a name through `flexrt/__init__`'s lazy loading, and the loose modules at the top level.

`python tools/import_graph.py` prints what it finds and exits 1 if anything breaks the rules (tests/test_project.py
runs it); `--graph` also prints every module's in-package imports.
"""
import ast, collections, json, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_TOP_LEVEL = 8   # loose modules beside the packages

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
