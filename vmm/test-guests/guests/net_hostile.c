/* A hostile guest on virtio-net: sends, through the first virtio-net
 * device, the raw frames a guest kernel could emit to get past its VM's
 * host-side network rules, then, last, the one legitimate datagram (the
 * positive control: its arrival means every earlier frame was already
 * through the host's stack). Every UDP datagram carries a distinct payload
 * "hostile:<name>" so a receiver can tell them apart.
 *
 * The guest sits at 172.16.0.2 behind the gateway 172.16.0.1 (host-agent's
 * fixed addressing). Command line (addresses as dotted quads; all needed):
 *   gw_mac=MAC      the gateway's (the tap's) MAC
 *   allowed=A       an allowed destination
 *   allowed_port=P  its allowed UDP port; denied_port=P one not allowed
 *   probe_port=P    the UDP port of the probes to denied addresses
 *   node=A          the node's address; node_veth=A its end of the VM's veth
 *   vm_ip=A         the VM's pool address (the namespace's end of the veth)
 *   other_vm=A      another VM's pool address
 *   inet_peer=A     an address of the internet side (a forged source)
 *   v6=HEX          an IPv6 destination, 32 hex digits
 *   v6_routed=1     the namespace routes IPv6 (its guest is fd00:ac10::2
 *                   behind fd00:ac10::1): also send an IPv6 neighbour
 *                   advertisement claiming the gateway's address, a
 *                   datagram from the guest's address to the IPv6 metadata
 *                   address, and, last, an IPv6 positive control from the
 *                   guest's address to v6 at allowed_port
 *   hold=1          spin at the end instead of resetting
 * Prints "hostile: sent <name>" per frame and "hostile: sent=N" at the end. */
#include "virtio.h"

#define GUEST_IP 0xac100002u   /* 172.16.0.2 */
#define GATEWAY_IP 0xac100001u /* 172.16.0.1 */
#define FORGED_IP 0xac100009u  /* 172.16.0.9: the guest's /12, not its address */
#define CMDLINE_MAX 4096u
#define FRAME_MAX 1514u
#define HDR 12u /* struct virtio_net_hdr_v1, all zero: no offloads */

static struct vring rxq, txq;
static u8 buf[HDR + FRAME_MAX] __attribute__((aligned(16)));
static u32 flen; /* bytes of the Ethernet frame in buf after the header */
static u64 base;
static u32 sent;
static u16 ip_id = 0x4000;

static u8 mac[6], gw_mac[6];
static const u8 bcast[6] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
static const u8 forged_mac[6] = {0x06, 0x66, 0x66, 0x66, 0x66, 0x66};
static u32 allowed, node, node_veth, vm_ip, other_vm, inet_peer;
static u16 allowed_port, denied_port, probe_port;
static u8 v6dst[16];
static const u8 guest6[16] = {0xfd, 0x00, 0xac, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2};
static const u8 gateway6[16] = {0xfd, 0x00, 0xac, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
static const u8 metadata6[16] = {0xfd, 0x00, 0x0e, 0xc2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x54};

/* ---- command line ---- */

/* The value of "key=" in the command line (NUL-terminated, scanned at most
 * CMDLINE_MAX bytes), or 0. */
static const char *arg(const char *cmdline, const char *key) {
    for (u32 i = 0; i < CMDLINE_MAX && cmdline[i]; i++) {
        if (i && cmdline[i - 1] != ' ') continue;
        u32 k = 0;
        while (key[k] && i + k < CMDLINE_MAX && cmdline[i + k] == key[k]) k++;
        if (key[k] || i + k >= CMDLINE_MAX || cmdline[i + k] != '=') continue;
        return cmdline + i + k + 1;
    }
    return 0;
}

static int at_end(char c) { return c == 0 || c == ' '; }

/* a.b.c.d, each 0..255 in at most three digits. */
static int parse_ip(const char *v, u32 *out) {
    u32 ip = 0;
    for (int part = 0; part < 4; part++) {
        u32 n = 0, digits = 0;
        while (*v >= '0' && *v <= '9' && digits < 3) { n = n * 10 + (u32)(*v - '0'); v++; digits++; }
        if (!digits || n > 255) return 0;
        ip = (ip << 8) | n;
        if (part < 3) {
            if (*v != '.') return 0;
            v++;
        }
    }
    if (!at_end(*v)) return 0;
    *out = ip;
    return 1;
}

/* 1..65535 in at most five digits. */
static int parse_port(const char *v, u16 *out) {
    u32 n = 0, digits = 0;
    while (*v >= '0' && *v <= '9' && digits < 5) { n = n * 10 + (u32)(*v - '0'); v++; digits++; }
    if (!digits || n == 0 || n > 65535 || !at_end(*v)) return 0;
    *out = (u16)n;
    return 1;
}

/* `count` bytes as hex pairs, separated by `sep` (0: none). */
static int parse_hex_bytes(const char *v, u8 *out, u32 count, char sep) {
    for (u32 i = 0; i < count; i++) {
        if (!is_hex(v[0]) || !is_hex(v[1])) return 0;
        out[i] = (u8)(hex_digit(v[0]) * 16 + hex_digit(v[1]));
        v += 2;
        if (sep && i + 1 < count) {
            if (*v != sep) return 0;
            v++;
        }
    }
    return at_end(*v);
}

static void need(int ok, const char *key) {
    if (ok) return;
    puts("hostile: bad or missing ");
    puts(key);
    putc('\n');
    reset();
}

static void need_ip(const char *cmdline, const char *key, u32 *out) {
    const char *v = arg(cmdline, key);
    need(v && parse_ip(v, out), key);
}

static void need_port(const char *cmdline, const char *key, u16 *out) {
    const char *v = arg(cmdline, key);
    need(v && parse_port(v, out), key);
}

/* ---- frames ---- */

static void be16(u8 *p, u16 v) { p[0] = (u8)(v >> 8); p[1] = (u8)v; }
static void be32(u8 *p, u32 v) { be16(p, (u16)(v >> 16)); be16(p + 2, (u16)v); }
static void copy(u8 *dst, const void *src, u32 n) {
    const u8 *s = (const u8 *)src;
    for (u32 i = 0; i < n; i++) dst[i] = s[i];
}
static u32 str_len(const char *s) { u32 n = 0; while (s[n] && n < 256) n++; return n; }

static u32 sum16(u32 sum, const u8 *p, u32 n) {
    for (u32 i = 0; i + 1 < n; i += 2) sum += (u32)(p[i] << 8 | p[i + 1]);
    if (n & 1) sum += (u32)p[n - 1] << 8;
    return sum;
}
static u16 fold(u32 sum) {
    while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
    return (u16)~sum;
}

/* Starts a frame: the virtio-net header, then Ethernet to `dst`, from `src`;
 * returns where the payload goes. */
static u8 *eth(const u8 *dst, const u8 *src, u16 type) {
    for (u32 i = 0; i < sizeof(buf); i++) buf[i] = 0;
    u8 *e = buf + HDR;
    copy(e, dst, 6);
    copy(e + 6, src, 6);
    be16(e + 12, type);
    flen = 14;
    return e + 14;
}

/* Writes an IPv4 header (with `optlen` bytes of options, a multiple of 4,
 * at most 40) at `p` for `l4len` bytes after it; `frag` is the flags and
 * offset field. Returns the header's length and counts it into the frame. */
static u32 ip4(u8 *p, u32 src, u32 dst, u8 proto, u32 l4len, u16 id, u16 frag,
               const u8 *opt, u32 optlen) {
    if (optlen > 40 || optlen % 4) optlen = 0;
    u32 hl = 20 + optlen;
    if (flen + hl + l4len > FRAME_MAX) l4len = 0;
    p[0] = (u8)(0x40 | (hl / 4));
    p[1] = 0;
    be16(p + 2, (u16)(hl + l4len));
    be16(p + 4, id);
    be16(p + 6, frag);
    p[8] = 64;
    p[9] = proto;
    be16(p + 10, 0);
    be32(p + 12, src);
    be32(p + 16, dst);
    if (optlen) copy(p + 20, opt, optlen);
    be16(p + 10, fold(sum16(0, p, hl)));
    flen += hl + l4len;
    return hl;
}

/* Writes a UDP header and payload `tag` at `p` (checksum 0: none, as IPv4
 * allows), padded with zeros to `pad` bytes of payload; returns its length. */
static u32 udp(u8 *p, u16 sport, u16 dport, const char *tag, u32 pad) {
    u32 n = str_len(tag);
    if (pad < n) pad = n;
    if (pad > 1400) pad = 1400;
    be16(p, sport);
    be16(p + 2, dport);
    be16(p + 4, (u16)(8 + pad));
    be16(p + 6, 0);
    copy(p + 8, tag, n < pad ? n : pad);
    return 8 + pad;
}

/* A whole UDP-in-IPv4 frame to the gateway's MAC. */
static void udp4(u32 src, u32 dst, u16 sport, u16 dport, const char *tag) {
    u8 *l3 = eth(gw_mac, mac, 0x0800);
    u32 l4 = 8 + str_len(tag);
    u32 hl = ip4(l3, src, dst, 17, l4, ip_id++, 0x4000 /* DF */, 0, 0);
    udp(l3 + hl, sport, dport, tag, 0);
}

/* Hands the frame to the device and waits for it to be taken. */
static void send(const char *name) {
    u32 len = flen < 60 ? 60 : flen;
    vq_desc_set(&txq, 0, (u64)buf, HDR + len, 0, 0);
    if (vq_run(base, 1, &txq, 0) == 0xffffffffu) {
        puts("hostile: tx timeout at ");
        puts(name);
        putc('\n');
        reset();
    }
    sent++;
    puts("hostile: sent ");
    puts(name);
    putc('\n');
}

static void arp(const u8 *edst, const u8 *sha, u16 op, u32 spa, const u8 *tha, u32 tpa,
                const char *name) {
    u8 *a = eth(edst, sha, 0x0806);
    be16(a, 1);
    be16(a + 2, 0x0800);
    a[4] = 6;
    a[5] = 4;
    be16(a + 6, op);
    copy(a + 8, sha, 6);
    be32(a + 14, spa);
    copy(a + 18, tha, 6);
    be32(a + 24, tpa);
    flen += 28;
    send(name);
}

/* IPv6 header at `p` for `l4len` bytes of `next`; fills in the upper-layer
 * checksum at `p + 40 + csum_at` over the pseudo-header. */
static void ip6(u8 *p, const u8 *src, const u8 *dst, u8 next, u8 hops, u32 l4len, u32 csum_at) {
    if (flen + 40 + l4len > FRAME_MAX || csum_at + 2 > l4len) return;
    p[0] = 0x60;
    be16(p + 4, (u16)l4len);
    p[6] = next;
    p[7] = hops;
    copy(p + 8, src, 16);
    copy(p + 24, dst, 16);
    u8 *l4 = p + 40;
    be16(l4 + csum_at, 0);
    u32 sum = sum16(0, src, 16);
    sum = sum16(sum, dst, 16);
    sum += l4len;
    sum += next;
    sum = sum16(sum, l4, l4len);
    u16 c = fold(sum);
    be16(l4 + csum_at, c ? c : 0xffff);
    flen += 40 + l4len;
}

static void router_advertisement(void) {
    static const u8 all_nodes_mac[6] = {0x33, 0x33, 0, 0, 0, 1};
    static const u8 all_nodes[16] = {0xff, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    u8 ll[16] = {0xfe, 0x80};
    ll[8] = (u8)(mac[0] ^ 2); ll[9] = mac[1]; ll[10] = mac[2]; ll[11] = 0xff;
    ll[12] = 0xfe; ll[13] = mac[3]; ll[14] = mac[4]; ll[15] = mac[5];
    u8 *l3 = eth(all_nodes_mac, mac, 0x86dd);
    u8 *ra = l3 + 40;
    ra[0] = 134;            /* router advertisement */
    ra[4] = 64;             /* current hop limit */
    be16(ra + 6, 1800);     /* router lifetime: a default router */
    u8 *pi = ra + 16;       /* prefix information: 2001:db8:1::/64, autonomous */
    pi[0] = 3; pi[1] = 4; pi[2] = 64; pi[3] = 0xc0;
    be32(pi + 4, 86400);
    be32(pi + 8, 14400);
    pi[16] = 0x20; pi[17] = 0x01; pi[18] = 0x0d; pi[19] = 0xb8; pi[21] = 0x01;
    u8 *sl = pi + 32;       /* source link-layer address */
    sl[0] = 1; sl[1] = 1;
    copy(sl + 2, mac, 6);
    ip6(l3, ll, all_nodes, 58, 255, 16 + 32 + 8, 2);
    send("ipv6-ra");
}

/* A UDP-in-IPv6 datagram from `src` to `dst`, tagged, to the gateway's MAC. */
static void udp6_from(const u8 *src, const u8 *dst, u16 sport, const char *tag, const char *name) {
    u8 *l3 = eth(gw_mac, mac, 0x86dd);
    u32 l4 = udp(l3 + 40, sport, allowed_port, tag, 0);
    ip6(l3, src, dst, 17, 64, l4, 6);
    send(name);
}

static void udp6(void) {
    static const u8 src[16] = {0x20, 0x01, 0x0d, 0xb8, 0, 0x01, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2};
    udp6_from(src, v6dst, 40000, "hostile:ipv6-udp", "ipv6-udp");
}

/* An unsolicited, overriding neighbour advertisement from the guest's
 * address claiming the gateway's address for the forged MAC. */
static void neighbour_advert_gateway(void) {
    static const u8 all_nodes_mac[6] = {0x33, 0x33, 0, 0, 0, 1};
    static const u8 all_nodes[16] = {0xff, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    u8 *l3 = eth(all_nodes_mac, mac, 0x86dd);
    u8 *na = l3 + 40;
    for (u32 i = 0; i < 32; i++) na[i] = 0;
    na[0] = 136;            /* neighbour advertisement */
    na[4] = 0x20;           /* override */
    copy(na + 8, gateway6, 16);
    na[24] = 2; na[25] = 1; /* target link-layer address */
    copy(na + 26, forged_mac, 6);
    ip6(l3, guest6, all_nodes, 58, 255, 32, 2);
    send("ipv6-na-gateway");
}

static void dhcp_discover(void) {
    u8 *l3 = eth(bcast, mac, 0x0800);
    u32 hl = ip4(l3, 0, 0xffffffffu, 17, 8 + 300, ip_id++, 0, 0, 0);
    u8 *u = l3 + hl;
    udp(u, 68, 67, "", 300);
    u8 *b = u + 8;
    b[0] = 1; b[1] = 1; b[2] = 6;          /* BOOTREQUEST, Ethernet */
    be32(b + 4, 0x686f7374);               /* xid */
    be16(b + 10, 0x8000);                  /* broadcast */
    copy(b + 28, mac, 6);                  /* chaddr */
    copy(b + 44, "hostile:dhcp", 12);      /* sname: the tag */
    be32(b + 236, 0x63825363);             /* magic cookie */
    b[240] = 53; b[241] = 1; b[242] = 1;   /* DHCPDISCOVER */
    b[243] = 255;
    send("dhcp-discover");
}

/* One fragment of a 32-byte UDP datagram `dgram` to `dst`: bytes
 * [off, off + len) with more-fragments `mf`. */
static void fragment(u32 dst, const u8 *dgram, u16 id, u32 off, u32 len, int mf, const char *name) {
    if (off % 8 || off + len > 32) return;
    u8 *l3 = eth(gw_mac, mac, 0x0800);
    u32 hl = ip4(l3, GUEST_IP, dst, 17, len, id, (u16)((mf ? 0x2000 : 0) | (off / 8)), 0, 0);
    copy(l3 + hl, dgram + off, len);
    send(name);
}

static void fragments(void) {
    u8 d[8 + 24];
    /* A datagram to the port not allowed, in two fragments. */
    for (u32 i = 0; i < sizeof(d); i++) d[i] = 0;
    udp(d, 40001, denied_port, "hostile:frag-denied", 24);
    u16 id = ip_id++;
    fragment(allowed, d, id, 0, 16, 1, "frag-denied-1");
    fragment(allowed, d, id, 16, 16, 0, "frag-denied-2");
    /* A first fragment to the allowed port, then an overlapping one that
     * rewrites the port to the one not allowed, then the last. */
    for (u32 i = 0; i < sizeof(d); i++) d[i] = 0;
    udp(d, 40002, allowed_port, "hostile:frag-overlap", 24);
    u8 o[8 + 24];
    copy(o, d, sizeof(o));
    be16(o + 2, denied_port);
    id = ip_id++;
    fragment(allowed, d, id, 0, 16, 1, "frag-overlap-1");
    fragment(allowed, o, id, 0, 24, 1, "frag-overlap-2");
    fragment(allowed, d, id, 24, 8, 0, "frag-overlap-3");
    /* A lone trailing fragment (no first one to reassemble with). */
    for (u32 i = 0; i < sizeof(d); i++) d[i] = 0;
    copy(d + 16, "hostile:fraglone", 16);
    fragment(allowed, d, ip_id++, 16, 16, 0, "frag-lone");
}

/* Loose source route through the gateway on to the other VM. */
static void source_routed(void) {
    u8 opt[8] = {0x83, 7, 4};
    be32(opt + 3, other_vm);
    opt[7] = 1; /* NOP */
    u8 *l3 = eth(gw_mac, mac, 0x0800);
    const char *tag = "hostile:lsrr";
    u32 hl = ip4(l3, GUEST_IP, GATEWAY_IP, 17, 8 + str_len(tag), ip_id++, 0, opt, sizeof(opt));
    udp(l3 + hl, 40003, probe_port, tag, 0);
    send("lsrr");
}

void guest_main(const u8 *zp) {
    puts("hostile: begin\n");
    const char *cmdline = guest_cmdline(zp);
    const char *v = arg(cmdline, "gw_mac");
    need(v && parse_hex_bytes(v, gw_mac, 6, ':'), "gw_mac");
    v = arg(cmdline, "v6");
    need(v && parse_hex_bytes(v, v6dst, 16, 0), "v6");
    need_ip(cmdline, "allowed", &allowed);
    need_ip(cmdline, "node", &node);
    need_ip(cmdline, "node_veth", &node_veth);
    need_ip(cmdline, "vm_ip", &vm_ip);
    need_ip(cmdline, "other_vm", &other_vm);
    need_ip(cmdline, "inet_peer", &inet_peer);
    need_port(cmdline, "allowed_port", &allowed_port);
    need_port(cmdline, "denied_port", &denied_port);
    need_port(cmdline, "probe_port", &probe_port);

    base = virtio_find(zp, 1);
    if (!base) { puts("hostile: no device\n"); reset(); }
    if (virtio_init(base, 1u << 5) < 0) { puts("hostile: features refused\n"); reset(); }
    for (int i = 0; i < 6; i++) mac[i] = *(volatile u8 *)(base + VIRTIO_CONFIG + i);
    vq_setup(base, 0, &rxq, QSZ);
    vq_setup(base, 1, &txq, QSZ);
    if (!(virtio_driver_ok(base) & S_DRIVER_OK)) { puts("hostile: driver not ok\n"); reset(); }

    /* Forged sources to the allowed address and port. */
    udp4(FORGED_IP, allowed, 40010, allowed_port, "hostile:forged-guestnet");
    send("forged-guestnet");
    udp4(inet_peer, allowed, 40011, allowed_port, "hostile:forged-inet");
    send("forged-inet");
    udp4(vm_ip, allowed, 40012, allowed_port, "hostile:forged-vmip");
    send("forged-vmip");
    /* Denied destinations. */
    udp4(GUEST_IP, 0xa9fea9feu, 40020, probe_port, "hostile:metadata");
    send("metadata");
    udp4(GUEST_IP, node, 40021, probe_port, "hostile:node");
    send("node");
    udp4(GUEST_IP, node_veth, 40022, probe_port, "hostile:node-veth");
    send("node-veth");
    udp4(GUEST_IP, other_vm, 40023, probe_port, "hostile:other-vm");
    send("other-vm");
    udp4(GUEST_IP, allowed, 40024, denied_port, "hostile:denied-port");
    send("denied-port");
    /* The namespace itself: only DNS at the gateway is let in. */
    udp4(GUEST_IP, GATEWAY_IP, 40025, probe_port, "hostile:gateway-port");
    send("gateway-port");
    udp4(GUEST_IP, vm_ip, 40026, probe_port, "hostile:ns-addr");
    send("ns-addr");
    dhcp_discover();
    /* ARP: a gratuitous request and reply claiming the gateway's address,
     * replies poisoning the gateway's view of its upstream, a request from
     * the upstream's address. */
    static const u8 zero[6] = {0};
    arp(bcast, mac, 1, GATEWAY_IP, zero, GATEWAY_IP, "garp-request");
    arp(bcast, mac, 2, GATEWAY_IP, bcast, GATEWAY_IP, "garp-reply");
    arp(gw_mac, forged_mac, 2, GATEWAY_IP, gw_mac, GATEWAY_IP, "arp-poison-gateway");
    arp(gw_mac, forged_mac, 2, node_veth, gw_mac, GATEWAY_IP, "arp-poison-upstream");
    arp(gw_mac, forged_mac, 2, allowed, gw_mac, GATEWAY_IP, "arp-poison-allowed");
    arp(bcast, forged_mac, 1, node_veth, zero, GATEWAY_IP, "arp-request-as-upstream");
    /* IPv6: a router advertisement with a prefix, a datagram out from a
     * forged source; where the namespace routes IPv6, a neighbour claim and
     * the metadata address from the guest's own address. */
    router_advertisement();
    udp6();
    u64 v6_routed = 0;
    cmdline_u64(cmdline, "v6_routed", &v6_routed);
    if (v6_routed) {
        neighbour_advert_gateway();
        udp6_from(guest6, metadata6, 40030, "hostile:ipv6-metadata", "ipv6-metadata");
    }
    /* IPv4 options and fragments. */
    source_routed();
    fragments();
    /* Last, the positive controls. */
    if (v6_routed) udp6_from(guest6, v6dst, 40098, "hostile:control6", "control6");
    udp4(GUEST_IP, allowed, 40099, allowed_port, "hostile:control");
    send("control");

    kv_dec("hostile: sent", sent);
    u64 hold = 0;
    cmdline_u64(cmdline, "hold", &hold);
    if (hold)
        for (;;) __asm__ volatile("pause");
    reset();
}
