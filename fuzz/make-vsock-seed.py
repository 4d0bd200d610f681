#!/usr/bin/env python3
"""Writes the seed input of the virtio_vsock fuzz target: a driver that sets
the device up (3 queues of 16), posts 4 receive buffers, connects from guest
port 5000 to host port 1024 and sends "hello"; the host side accepts and
answers, and a host process connects to guest port 52. Layout and op encoding
follow fuzz_targets/virtio_vsock.rs."""
import struct
import sys

SEED = 16 << 10
QSZ = 16
mem = bytearray(SEED)
ops = bytearray()


def w(reg, value):
    ops.extend(struct.pack("<BBI", 0, reg // 4, value))


def op(kind, a=0, value=0):
    ops.extend(struct.pack("<BBI", kind, a, value))


def desc(base, i, addr, length, flags=0, nxt=0):
    struct.pack_into("<QIHH", mem, base + 16 * i, addr, length, flags, nxt)


def avail(base, heads):
    struct.pack_into("<HH", mem, base, 0, len(heads))
    for i, h in enumerate(heads):
        struct.pack_into("<H", mem, base + 4 + 2 * i, h)


def header(src_port, dst_port, opcode, payload=b""):
    # src_cid, dst_cid, src_port, dst_port, len, type, op, flags, buf_alloc, fwd_cnt
    return struct.pack("<QQIIIHHIII", 3, 2, src_port, dst_port, len(payload), 1, opcode, 0, 65536, 0) + payload


# Queues: rx at 0x0000, tx at 0x1000, event at 0x2000 (desc, avail +0x400, used +0x800).
for i in range(4):
    desc(0x0000, i, 0x10000 + i * 0x1000, 0x1000, flags=2)  # device-writable
avail(0x0400, [0, 1, 2, 3])
request = header(5000, 1024, 1)
rw = header(5000, 1024, 5, b"hello")
mem[0x3000:0x3000 + len(request)] = request
mem[0x3100:0x3100 + len(rw)] = rw
desc(0x1000, 0, 0x3000, len(request))
desc(0x1000, 1, 0x3100, len(rw))
avail(0x1400, [0, 1])
desc(0x2000, 0, 0x3800, 8, flags=2)
avail(0x2400, [0])

w(0x70, 1)
w(0x70, 3)
w(0x24, 1)
w(0x20, 1)  # VIRTIO_F_VERSION_1
w(0x70, 11)
for q in range(3):
    base = q * 0x1000
    w(0x30, q)
    w(0x38, QSZ)
    w(0x80, base)
    w(0x90, base + 0x400)
    w(0xA0, base + 0x800)
    w(0x44, 1)
w(0x70, 15)
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
sys.stdout.buffer.write(bytes(mem) + bytes(ops))
