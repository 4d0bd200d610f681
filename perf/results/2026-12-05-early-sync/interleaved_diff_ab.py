#!/usr/bin/env python3
"""Interleaved A/B of diff snapshot writes between vmm binaries.

Usage: interleaved_diff_ab.py N LABEL:VMM_BINARY ...
  (env MEM=MiB, default 256; PM=dirty permille, default 10; DIRTIER=path of
  the dirtier test guest, default the newest under target/release/build)

Boots one dirtier guest per binary and takes N diff snapshots from each,
one binary after the other, so the disk's drift and the host's load fall
on all of them alike. Only the guest being measured runs: each is resumed,
waits for a complete dirtying pass, is paused and snapshotted, and stays
paused. Clock: the snapshot request's round trip on the control socket,
as perf snapshot-write measures it. Run from the repository root.
"""
import subprocess,socket,json,time,os,shutil,sys,statistics,threading
G=os.environ.get('DIRTIER') or sorted([os.path.join(r,'dirtier.elf') for r,d,f in os.walk('target/release/build') if 'dirtier.elf' in f],key=os.path.getmtime)[-1]
specs=[a.split(':',1) for a in sys.argv[2:]]; N=int(sys.argv[1]); MEM=os.environ.get("MEM","256"); PM=os.environ.get("PM","10")
class VM:
    def __init__(s,label,binary):
        s.label=label; s.dir=f"/tmp/interleaved-ab/{label}"; shutil.rmtree(s.dir,ignore_errors=True); os.makedirs(s.dir)
        s.p=subprocess.Popen([binary,"run","--kernel",G,"--cmdline",f"permille={PM}","--mem-mib",MEM,"--control-socket",s.dir+"/ctl"],stdout=subprocess.PIPE,stderr=subprocess.DEVNULL)
        s.passes=0; s.cv=threading.Condition()
        threading.Thread(target=s.reader,daemon=True).start()
        while not os.path.exists(s.dir+"/ctl"): time.sleep(0.01)
        s.s=socket.socket(socket.AF_UNIX); s.s.connect(s.dir+"/ctl"); s.f=s.s.makefile('rw'); s.k=0; s.times=[]
    def reader(s):
        for line in s.p.stdout:
            if line.startswith(b"pass="):
                with s.cv: s.passes+=1; s.cv.notify_all()
    def rq(s,r):
        s.f.write(json.dumps(r)+"\n"); s.f.flush(); return json.loads(s.f.readline())
    def snap(s,kind):
        s.rq({"op":"resume"})
        with s.cv:
            want=s.passes+1
            s.cv.wait_for(lambda: s.passes>=want+0)
        s.rq({"op":"pause"})
        s.k+=1; d=f"{s.dir}/s{s.k}"
        t=time.perf_counter(); r=s.rq({"op":"snapshot","dir":d,"kind":kind}); dt=(time.perf_counter()-t)*1e3
        assert r.get("ok"),r
        if s.k>2: shutil.rmtree(f"{s.dir}/s{s.k-2}")
        return dt
vms=[VM(*sp) for sp in specs]
for v in vms: v.snap("full")
time.sleep(0.2)
for i in range(N):
    for v in vms: v.times.append(v.snap("diff"))
for v in vms:
    t=sorted(v.times); print(f"{v.label}: median {statistics.median(t):.2f} ms p25 {t[len(t)//4]:.2f} p75 {t[3*len(t)//4]:.2f}")
    v.rq({"op":"stop"})
