#!/bin/sh
# /init of the outer VM (L1): Debian's generic kernel with kvm_amd under QEMU's
# software emulation. Loads KVM and 9p, mounts the host's / read-only and the
# harness's work directory read-write (both over 9p), and runs the command
# the harness left in that directory, chrooted into the host's tree, so the
# host's binaries run unchanged, with its output on the second serial port. A heartbeat line every 10 s tells the
# harness L1 is alive, whatever the scenarios are doing.
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
echo "L1: init started, uptime $(cut -d' ' -f1 /proc/uptime)s"
for m in $(cat /mods/order); do insmod "/mods/$m" 2>&1 | sed "s/^/L1: insmod $m: /"; done
arg() { sed -n "s/.*[[:space:]]$1=\([^[:space:]]*\).*/\1/p" /proc/cmdline | head -n 1; }
work=$(arg l1.work)
keep=$(arg l1.keep | tr ',' ' ')
cmd=$(arg l1.cmd)
H=/host
mkdir -p $H /work
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose host $H || echo "L1: FAIL mount 9p host"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 work /work || echo "L1: FAIL mount 9p work"
mount -t proc proc $H/proc
mount -t sysfs sys $H/sys
mount -t devtmpfs dev $H/dev
mkdir -p /dev/pts 2>/dev/null; mount -t devpts devpts $H/dev/pts 2>/dev/null
# L1's own /tmp, /run and /var/tmp (scratch in its memory) replace the
# host's. Host directories the runner needs (l1.keep: the checkout, the
# cache) that lie in one of them are set aside first and put back after.
i=0
for p in $keep; do
	case "$p" in /tmp/* | /run/* | /var/tmp/*)
		mkdir -p /keep/$i && mount --bind "$H$p" /keep/$i || echo "L1: FAIL keep $p"
		i=$((i + 1)) ;;
	esac
done
for d in tmp run var/tmp; do mount -t tmpfs -o mode=1777,size=90% tmpfs "$H/$d" || echo "L1: FAIL tmpfs /$d"; done
i=0
for p in $keep; do
	case "$p" in /tmp/* | /run/* | /var/tmp/*)
		mkdir -p "$H$p" && mount --bind /keep/$i "$H$p" || echo "L1: FAIL put back $p"
		i=$((i + 1)) ;;
	esac
done
mkdir -p "$H$work" 2>/dev/null
mount --bind /work "$H$work" || echo "L1: FAIL bind $work"
mount -t cgroup2 cgroup2 $H/sys/fs/cgroup 2>/dev/null
mount -t debugfs debugfs $H/sys/kernel/debug 2>/dev/null
mount -t tracefs tracefs $H/sys/kernel/tracing 2>/dev/null
ip link set lo up 2>/dev/null
# Each heartbeat carries what the harness records of L1 when it gives up on
# it: free memory and the load.
(while :; do
	echo "L1-HEARTBEAT $(cut -d' ' -f1 /proc/uptime) mem_avail_kib=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo) load=$(cut -d' ' -f1-3 /proc/loadavg | tr ' ' ,)"
	sleep 10
done) &
hb=$!
if [ -c /dev/kvm ]; then kvm=yes; else kvm=no; fi
echo "L1: ready, uptime $(cut -d' ' -f1 /proc/uptime)s, kvm=$kvm"
if [ -n "$cmd" ]; then
	# The runner's output goes to the second serial port, apart from this
	# kernel's console: nothing a scenario relays is read as L1's own.
	chroot $H /bin/bash "$cmd" </dev/null >/dev/ttyS1 2>&1
	echo "L1-DONE rc=$?"
else
	sh
fi
kill $hb
sync
poweroff -f
