#!/usr/bin/env python3
"""A stand-in VMM for testing the perf harness's scenario logic without a
snapshot-capable vmm: it speaks the vmm's interface (issue 3: `run`,
`restore --snapshot`, control-socket `pause`/`resume`/`snapshot`/`stop`) or,
when given --api-sock, Firecracker's HTTP API. It runs no guest: it prints
what the test guests print (hello line, count=N, pass=K; the counter's
`counter: idle` after its `halt_after=K`-th count) and keeps an
anonymous mapping of the guest's memory size. Timings mean nothing.

With a tap (`--net TAP,...`, or Firecracker's `PUT /network-interfaces/eth0`)
and the net_perf guest, it plays that guest's part on the tap itself (modes
tx, rx and echo; see vmm/test-guests/guests/net_perf.c for the frames).

FAKE_NO_RESTORE=1 makes it a vmm without the restore subcommand."""

import fcntl
import json
import mmap
import os
import socket
import socketserver
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler


TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
ETHERTYPE = b"\x88\xb5"


def cmdline_value(cmdline, key, default=None):
    for word in cmdline.split():
        if word.startswith(key + "="):
            return word[len(key) + 1:]
    return default


def net_perf(tap, cmdline, out):
    """The net_perf guest's part, on tap `tap` (no virtio-net header)."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", tap.encode(), IFF_TAP | IFF_NO_PI))
    mode = cmdline_value(cmdline, "mode")
    count = int(cmdline_value(cmdline, "count", "1000"))
    size = int(cmdline_value(cmdline, "size", "1514"))
    mac = b"\x02\x00\x00\x00\x00\x07"

    def frame(kind, length, extra=b""):
        head = b"\xff" * 6 + mac + ETHERTYPE + kind + b"\x00" + extra
        return head + b"\x00" * (length - len(head))

    def frames():
        while True:
            f = os.read(fd, 65536)
            if len(f) >= 15 and f[12:14] == ETHERTYPE:
                yield f

    out(f"net_perf: ready mode={mode} queue=256\n")
    if mode == "tx":
        next(f for f in frames() if f[14:15] == b"G")
        data = frame(b"T", size)
        for _ in range(count):
            os.write(fd, data)
        out(f"net_perf: tx done frames={count}\n")
    elif mode == "rx":
        got = nbytes = since = 0
        for f in frames():
            if f[14:15] == b"D":
                got, nbytes, since = got + 1, nbytes + len(f), since + 1
            if since and (since >= 64 or got == count):
                os.write(fd, frame(b"A", 64, struct.pack("<QQ", got, nbytes)))
                since = 0
            if got == count:
                break
        out(f"net_perf: rx done frames={got} bytes={nbytes}\n")
    elif mode == "echo":
        for f in frames():
            os.write(fd, f)
    os._exit(0)


class Guest:
    def __init__(self, kind, mem_mib, cmdline, count=0, passes=0, tap=None):
        self.kind = kind
        self.tap = tap
        self.mem_mib = mem_mib
        self.cmdline = cmdline
        self.count = count
        self.passes = passes
        self.paused = threading.Event()
        self.running = threading.Event()
        self.memory = mmap.mmap(-1, mem_mib << 20)
        for off in range(0, 64 << 10, 4096):  # touch a few pages, like a guest
            self.memory[off] = 1

    def out(self, text):
        sys.stdout.write(text)
        sys.stdout.flush()

    def run(self):
        self.running.wait()
        if self.kind == "net_perf" and self.tap:
            net_perf(self.tap, self.cmdline, self.out)
        if self.kind == "hello":
            self.out("Hello from the hello test guest!\n")
            os._exit(0)
        if self.kind == "dirtier" and self.passes == 0:
            self.out("dirtier: start pages=1\n")
        if self.kind == "counter" and self.count == 0:
            self.out("counter: start\n")
        # The counter's `interval=N` (a line per N, paced as a guest doing
        # an increment a microsecond) and `halt_after=K` (idle after count K).
        interval = int(cmdline_value(self.cmdline, "interval", "1") or "1")
        halt_after = int(cmdline_value(self.cmdline, "halt_after", "0") or "0")
        while True:
            if self.paused.is_set():
                time.sleep(0.0005)
                continue
            if self.kind == "dirtier":
                self.passes += 1
                self.out(f"pass={self.passes}\n")
                time.sleep(0.005)
            else:
                self.count += interval
                self.out(f"count={self.count}\n")
                if self.kind == "counter" and halt_after and self.count >= halt_after * interval:
                    self.out("counter: idle\n")
                    while True:
                        time.sleep(3600)
                time.sleep(max(0.001, interval * 1e-6))

    def snapshot(self, directory, kind):
        os.makedirs(directory)
        with open(os.path.join(directory, "state"), "w") as f:
            json.dump({"kind": self.kind, "mem_mib": self.mem_mib, "cmdline": self.cmdline,
                       "count": self.count, "passes": self.passes}, f)
        with open(os.path.join(directory, "memory"), "wb") as f:
            f.truncate((self.mem_mib << 20) if kind == "full" else 4096)

    @staticmethod
    def load(directory):
        with open(os.path.join(directory, "state")) as f:
            s = json.load(f)
        return Guest(s["kind"], s["mem_mib"], s["cmdline"], s["count"], s["passes"])


def guest_kind(kernel):
    return os.path.basename(kernel).split(".")[0]


def serve_control(path, guest, on_restore=None):
    """Serves the control socket; with `on_restore` (standby) there is no
    guest until a restore request, which `on_restore` turns into one."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    held = {"guest": guest}

    def client(conn):
        f = conn.makefile("rw")
        for line in f:
            req = json.loads(line)
            op = req.get("op")
            guest = held["guest"]
            ans = {"ok": True, "state": "running", "vcpus": 1}
            if guest is None:
                if op == "restore":
                    held["guest"] = on_restore(req)
                    ans["state"] = "paused" if req.get("paused") else "running"
                elif op == "status":
                    ans["state"] = "standby"
                else:
                    ans = {"ok": False, "error": "on standby"}
            elif op == "pause":
                guest.paused.set()
                ans["state"] = "paused"
            elif op == "resume":
                guest.paused.clear()
            elif op == "snapshot":
                if not guest.paused.is_set():
                    ans = {"ok": False, "error": "snapshot needs a paused VM"}
                else:
                    guest.snapshot(req["dir"], req["kind"])
                    written = guest.mem_mib << 20 if req["kind"] == "full" else 4096
                    ans = {"ok": True, "dir": os.path.realpath(req["dir"]),
                           "kind": req["kind"], "memory_bytes_written": written,
                           "pages_written": written // 4096, "ms": 0.0}
            elif op == "stop":
                f.write(json.dumps(ans) + "\n")
                f.flush()
                os._exit(0)
            f.write(json.dumps(ans) + "\n")
            f.flush()

    def accept():
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=client, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return held


def arg(args, name, default=None):
    return args[args.index(name) + 1] if name in args else default


# Options the vmm takes before its subcommand, each with a value.
GLOBAL_OPTIONS = ("--log-format", "--log-level", "--log-max-bytes")


def vmm_main(args):
    while args and args[0] in GLOBAL_OPTIONS:
        args = args[2:]
    if not args:
        sys.exit(2)
    if args[0] == "--version":
        print("vmm 0.0.0-fake")
        return
    cmd, args = args[0], args[1:]
    if cmd == "restore" and os.environ.get("FAKE_NO_RESTORE"):
        sys.stderr.write("error: unrecognized subcommand 'restore'\n")
        sys.exit(2)
    if "--help" in args:
        standby = cmd == "restore" and not os.environ.get("FAKE_NO_STANDBY")
        print(f"usage: vmm {cmd}" + (" [--standby]" if standby else ""))
        return
    if cmd == "run":
        net = arg(args, "--net")
        guest = Guest(guest_kind(arg(args, "--kernel")), int(arg(args, "--mem-mib", "128")),
                      arg(args, "--cmdline", ""), tap=net.split(",")[0] if net else None)
    elif cmd == "restore" and "--standby" in args:
        restored = threading.Event()

        def on_restore(req):
            g = Guest.load(req["snapshot"])
            if req.get("paused"):
                g.paused.set()
            restored.set()
            return g

        held = serve_control(arg(args, "--control-socket"), None, on_restore)
        restored.wait()
        guest = held["guest"]
        guest.running.set()
        guest.run()
        return
    elif cmd == "restore":
        guest = Guest.load(arg(args, "--snapshot"))
    else:
        sys.exit(2)
    sock = arg(args, "--control-socket")
    if sock:
        serve_control(sock, guest)
    if cmd == "restore" and "--paused" in args:
        guest.paused.set()
    guest.running.set()
    guest.run()


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def firecracker_main(args):
    if "--version" in args:
        print("Firecracker v0.0.0-fake")
        return
    state = {"guest": None, "boot": {}, "machine": {}, "net": None}

    class Api(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def reply(self, code, body=b""):
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def handle_req(self):
            n = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(n) or b"{}")
            g = state["guest"]
            if self.path == "/boot-source":
                state["boot"] = body
            elif self.path == "/machine-config":
                state["machine"] = body
            elif self.path == "/network-interfaces/eth0":
                state["net"] = body["host_dev_name"]
            elif self.path == "/actions" and body.get("action_type") == "InstanceStart":
                g = state["guest"] = Guest(guest_kind(state["boot"]["kernel_image_path"]),
                                           state["machine"]["mem_size_mib"],
                                           state["boot"].get("boot_args", ""), tap=state["net"])
                threading.Thread(target=g.run, daemon=True).start()
                g.running.set()
            elif self.path == "/vm" and g:
                if body.get("state") == "Paused":
                    g.paused.set()
                else:
                    g.paused.clear()
            elif self.path == "/snapshot/create" and g:
                d = os.path.dirname(body["snapshot_path"])
                with open(body["snapshot_path"], "w") as f:
                    json.dump({"kind": g.kind, "mem_mib": g.mem_mib, "cmdline": g.cmdline,
                               "count": g.count, "passes": g.passes}, f)
                with open(body["mem_file_path"], "wb") as f:
                    f.truncate(4096)
                del d
            elif self.path == "/snapshot/load":
                with open(body["snapshot_path"]) as f:
                    s = json.load(f)
                g = state["guest"] = Guest(s["kind"], s["mem_mib"], s["cmdline"], s["count"], s["passes"])
                threading.Thread(target=g.run, daemon=True).start()
                g.running.set()
            else:
                return self.reply(400, b'{"fault_message":"fake: unsupported"}')
            self.reply(204)

        do_PUT = handle_req
        do_PATCH = handle_req

    server = UnixHTTPServer(arg(args, "--api-sock"), Api)
    server.serve_forever()


if __name__ == "__main__":
    if "--api-sock" in sys.argv or os.path.basename(sys.argv[0]).startswith("fake_firecracker"):
        firecracker_main(sys.argv[1:])
    else:
        vmm_main(sys.argv[1:])
