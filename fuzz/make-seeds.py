#!/usr/bin/env python3
"""Writes the generated seed inputs of the virtio fuzz targets (run from fuzz/):

* corpus/virtio_vsock/guest-connect-and-data: a driver that sets the device
  up (3 queues of 16), posts 4 receive buffers, connects from guest port 5000
  to host port 1024 and sends "hello"; the host side accepts and answers, and
  a host process connects to guest port 52.
* corpus/virtio_net/tx-and-rx: a driver that sets the device up (2 queues of
  16), posts 4 receive buffers and sends one frame; the network sends two.

Layouts and op encodings follow fuzz_targets/virtio_vsock.rs and
fuzz_targets/virtio_net.rs."""
import struct

SEED = 16 << 10
QSZ = 16


class Driver:
    def __init__(self):
        self.mem = bytearray(SEED)

    def desc(self, base, i, addr, length, flags=0, nxt=0):
        struct.pack_into("<QIHH", self.mem, base + 16 * i, addr, length, flags, nxt)

    def avail(self, base, heads):
        struct.pack_into("<HH", self.mem, base, 0, len(heads))
        for i, h in enumerate(heads):
            struct.pack_into("<H", self.mem, base + 4 + 2 * i, h)

    def setup_writes(self, write, queues, features_hi=1, features_lo=0):
        """Status, features, queues at q*0x1000 (desc, avail +0x400, used +0x800)."""
        write(0x70, 1)
        write(0x70, 3)
        write(0x24, 0)
        write(0x20, features_lo)
        write(0x24, 1)
        write(0x20, features_hi)  # VIRTIO_F_VERSION_1
        write(0x70, 11)
        for q in range(queues):
            base = q * 0x1000
            write(0x30, q)
            write(0x38, QSZ)
            write(0x80, base)
            write(0x90, base + 0x400)
            write(0xA0, base + 0x800)
            write(0x44, 1)
        write(0x70, 15)


def vsock_seed():
    d = Driver()
    ops = bytearray()

    def w(reg, value):
        ops.extend(struct.pack("<BBI", 0, reg // 4, value))

    def op(kind, a=0, value=0):
        ops.extend(struct.pack("<BBI", kind, a, value))

    def header(src_port, dst_port, opcode, payload=b""):
        # src_cid, dst_cid, src_port, dst_port, len, type, op, flags, buf_alloc, fwd_cnt
        return struct.pack("<QQIIIHHIII", 3, 2, src_port, dst_port, len(payload), 1, opcode,
                           0, 65536, 0) + payload

    for i in range(4):
        d.desc(0x0000, i, 0x10000 + i * 0x1000, 0x1000, flags=2)  # device-writable
    d.avail(0x0400, [0, 1, 2, 3])
    request = header(5000, 1024, 1)
    rw = header(5000, 1024, 5, b"hello")
    d.mem[0x3000:0x3000 + len(request)] = request
    d.mem[0x3100:0x3100 + len(rw)] = rw
    d.desc(0x1000, 0, 0x3000, len(request))
    d.desc(0x1000, 1, 0x3100, len(rw))
    d.avail(0x1400, [0, 1])
    d.desc(0x2000, 0, 0x3800, 8, flags=2)
    d.avail(0x2400, [0])
    d.setup_writes(w, 3)
    w(0x50, 0)  # notify rx
    w(0x50, 1)  # notify tx: the request and the data
    op(3)
    op(5, 0, int.from_bytes(b"hi!\n", "little"))  # host accepts and answers
    op(3)
    op(3)
    op(4, 0, 52)  # a host process connects to guest port 52
    op(3)
    op(3)
    op(6, 0, 0)  # a host peer writes
    op(3)
    w(0x64, 1)  # interrupt ack
    return bytes(d.mem) + bytes(ops)


def net_seed():
    d = Driver()
    ops = bytearray()

    def w(reg, value):
        ops.extend(struct.pack("<BBI", 0, reg // 4, value))

    def frame(payload):
        eth = b"\xff" * 6 + bytes([2, 0, 0, 0, 0, 1]) + b"\x88\xb5" + payload
        return b"\x00" * 12 + eth.ljust(60, b"\x00")

    for i in range(4):
        d.desc(0x0000, i, 0x10000 + i * 0x800, 0x800, flags=2)
    d.avail(0x0400, [0, 1, 2, 3])
    tx = frame(b"from the guest")
    d.mem[0x3000:0x3000 + len(tx)] = tx
    d.desc(0x1000, 0, 0x3000, 12, flags=1, nxt=1)  # header, then the frame
    d.desc(0x1000, 1, 0x3000 + 12, len(tx) - 12)
    d.avail(0x1400, [0])
    d.setup_writes(w, 2, features_lo=1 << 5)  # VIRTIO_NET_F_MAC
    w(0x50, 0)
    w(0x50, 1)
    ops.append(3)  # event loop turn
    for payload in [b"from the network", b"x" * 1500]:
        f = frame(payload)
        ops.extend(struct.pack("<BH", 4, len(f)) + f)
        ops.append(3)
    w(0x64, 1)
    ops.extend(struct.pack("<BB", 2, 0x60 // 4))  # read the interrupt status
    return bytes(d.mem) + bytes(ops)


def write(path, data):
    import os
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


if __name__ == "__main__":
    write("corpus/virtio_vsock/guest-connect-and-data", vsock_seed())
    write("corpus/virtio_net/tx-and-rx", net_seed())
