#!/usr/bin/env python3
"""The import structure of the library (src/) and the protocol crate (proto/src): every import
points down the layers of docs/ARCHITECTURE.md and no two files import each other (a parent
module and its children aside). Prints each violation and exits 1; .ci/run runs it.

    python3 scripts/check-imports.py
"""

import collections
import os
import re
import sys

# The library's top-level modules, bottom up: a module may import only modules of a lower
# rank (or itself). proto/src is checked for circles only.
RANKS = {
    "host": 0, "metrics": 0, "memory": 1, "checksum": 2, "gpu": 3, "transport": 4,
    "config": 5, "discovery": 6, "driver": 6, "sender": 7, "receiver": 7, "engine": 8,
    "polled": 9, "testkit": 10,
}


def analyse(root):
    """(file-level import edges, circles among files that are not parent and child)."""
    files={}
    for d,_,fs in os.walk(root):
        for f in fs:
            if f.endswith('.rs'):
                p=os.path.join(d,f); rel=os.path.relpath(p,root)
                parts=rel[:-3].split('/')
                if parts[-1] in ('mod','lib','main'): parts=parts[:-1]
                files[tuple(parts)]=p
    def resolve(mod, path):
        # path: list of segments after crate:: or relative
        best=None
        for i in range(len(path),0,-1):
            if tuple(path[:i]) in files: return tuple(path[:i])
        return None
    edges=collections.defaultdict(set)
    for mod,p in files.items():
        src=open(p).read()
        src=re.sub(r'//[^\n]*','',src)
        # inline mod tests blocks are ignored roughly: drop #[cfg(test)] mod tests { ... } not handled
        for m in re.finditer(r'\b(crate|super)((?:::\w+)+)',src):
            kind,rest=m.group(1),m.group(2).split('::')[1:]
            if kind=='crate': path=rest
            else:
                base=list(mod) if os.path.basename(p) in ('mod.rs','lib.rs') else list(mod[:-1])
                # count chained super
                path=base+rest
                while 'super' in path:
                    i=path.index('super'); path=path[:i-1]+path[i+1:]
            t=resolve(mod,path)
            if t is not None and t!=mod: edges[mod].add(t)
    # sibling cycles: ignore edges parent<->child
    def parent(m): return m[:-1]
    def is_anc(a,b): return len(a)<len(b) and b[:len(a)]==a
    sib=collections.defaultdict(set)
    for a,bs in edges.items():
        for b in bs:
            if is_anc(a,b) or is_anc(b,a): continue
            sib[a].add(b)
    # find SCCs
    idx={};low={};st=[];on=set();res=[];c=[0]
    sys.setrecursionlimit(10000)
    def sc(v):
        idx[v]=low[v]=c[0];c[0]+=1;st.append(v);on.add(v)
        for w in sib[v]:
            if w not in idx: sc(w);low[v]=min(low[v],low[w])
            elif w in on: low[v]=min(low[v],idx[w])
        if low[v]==idx[v]:
            comp=[]
            while True:
                w=st.pop();on.discard(w);comp.append(w)
                if w==v:break
            if len(comp)>1: res.append(comp)
    for v in list(files):
        if v not in idx: sc(v)

    return edges, res


def main():
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    bad = []
    for root in ("src", "proto/src"):
        edges, circles = analyse(os.path.join(here, root))
        for comp in circles:
            bad.append(f"{root}: files importing each other: {sorted('/'.join(x) for x in comp)}")
        if root != "src":
            continue
        for a, bs in sorted(edges.items()):
            for b in sorted(bs):
                if not a or not b or a[0] == b[0]:
                    continue
                ra, rb = RANKS.get(a[0]), RANKS.get(b[0])
                if ra is None or rb is None:
                    bad.append(f"src: module {a[0] if ra is None else b[0]} has no layer in RANKS")
                elif rb >= ra:
                    bad.append(f"src: {'/'.join(a)} imports {'/'.join(b)}, a layer not below it")
    for b in sorted(set(bad)):
        print(b)
    if bad:
        sys.exit(1)
    print("check-imports: every import points down; no files import each other")


if __name__ == "__main__":
    main()
