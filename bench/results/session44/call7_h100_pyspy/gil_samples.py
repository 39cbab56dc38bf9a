import gzip, re, collections, sys
lines = gzip.open(sys.argv[1], 'rt').read().splitlines()
by_proc = collections.Counter(); by_thread = collections.Counter(); serving = collections.Counter()
leaf = collections.Counter(); leaf_thread = collections.defaultdict(collections.Counter)
procname = {}
for l in lines:
    stack, _, n = l.rpartition(' ')
    n = int(n)
    parts = stack.split(';')
    proc = parts[0]; thr = parts[1] if len(parts) > 1 else ''
    pid = proc.split(':')[0]
    frames = parts[2:]
    is_acc = any('_acceptor.py' in f and '<module>' not in f for f in frames) or any('acceptor_main' in f or 'moegemm/server/_acceptor.py' in f for f in frames)
    by_proc[pid] += n
    tname = re.sub(r'\(\d+\)', '', thr)
    by_thread[(pid, tname)] += n
    # serving phase: frames from the transport, engine worker, acceptors' owner side, copier
    text = ';'.join(frames)
    if any(k in text for k in ('_http_conn', '_acceptors.py', 'engine.py', '_executor.py', '_acceptor.py', '_fill', 'base_events.py', 'uvloop')) and 'capture' not in text and 'warm' not in text and '_load' not in text:
        serving[(pid, tname)] += n
        # the deepest moegemm frame and the deepest frame
        mg = [f for f in frames if 'moegemm' in f]
        key = (mg[-1] if mg else '?') + '  <<  ' + (frames[-1] if frames else '?')
        leaf[key] += n
        leaf_thread[(pid, tname)][mg[-1] if mg else frames[-1]] += n
print('samples by process', by_proc.most_common())
print('samples by thread', by_thread.most_common(12))
print('serving samples by thread', serving.most_common(12))
for t, c in serving.most_common(6):
    print('\n==', t, c)
    for k, v in leaf_thread[t].most_common(14):
        print(f'  {v:6d} {k}')
print('\n== top deepest (moegemm << leaf)')
for k, v in leaf.most_common(40):
    print(f'{v:6d} {k[:220]}')
