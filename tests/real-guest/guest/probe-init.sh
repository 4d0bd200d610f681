#!/bin/sh
# /init of the real-guest probe initramfs (busybox), run as PID 1 by a real
# Linux kernel under the project's vmm. It reports what the kernel sees as
# `RG-...` lines on the console; the scenario runner in L1 reads them.
#
# Kernel command line:
#   rg.mode=boot|serial|virtio|tick|urandom|share|fsperf|idle   what to do (below)
#   rg.end=reboot|poweroff|none               how to end (default reboot)
#   rg.ip=ADDR/PREFIX rg.peer=ADDR            virtio-net address and the L1 peer
#   rg.files=N rg.rounds=N                    fsperf: files per metadata round, reads of each
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /tmp && mount -t tmpfs tmp /tmp

arg() { sed -n "s/.*[[:space:]]$1=\([^[:space:]]*\).*/\1/p" /proc/cmdline | head -n 1; }
mode=$(arg rg.mode)
end=$(arg rg.end)
ip4=$(arg rg.ip)
peer=$(arg rg.peer)
files=$(arg rg.files)
rounds=$(arg rg.rounds)
say() { echo "$*"; }
hex() { od -An -tx1 | tr -d ' \n'; }

say "RG-BOOTED kernel=$(uname -r) uptime=$(cut -d' ' -f1 /proc/uptime)"

load_modules() {
	for m in $(cat /mods/order); do
		insmod "/mods/$m" 2>&1 | sed "s/^/RG-INSMOD: $m: /"
	done
	# Drivers bind asynchronously; wait (bounded) for the devices to appear.
	n=0
	while [ $n -lt 50 ]; do
		[ "$(ls /sys/bus/virtio/devices 2>/dev/null | wc -l)" -ge "${1:-1}" ] && break
		sleep 0.2
		n=$((n + 1))
	done
	for d in /sys/bus/virtio/devices/*; do
		[ -e "$d" ] || continue
		say "RG-VIRTIO $(basename "$d") device=$(cat "$d/device") driver=$(basename "$(readlink "$d/driver")")"
	done
}

facts() {
	say "RG-FACT cmdline $(cat /proc/cmdline)"
	say "RG-FACT nproc $(grep -c ^processor /proc/cpuinfo)"
	say "RG-FACT memtotal_kb $(sed -n 's/^MemTotal: *\([0-9]*\) kB/\1/p' /proc/meminfo)"
	say "RG-FACT clocksource $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource)"
	for d in /sys/bus/acpi/devices/*; do
		[ -e "$d" ] && say "RG-ACPI $(basename "$d")"
	done
	sed -n '/LOC\|IO-APIC\|timer/p' /proc/interrupts | sed 's/^/RG-IRQ: /'
}

# Kernel messages of level warning or worse (the console is slow under
# nested emulation, so not the whole log), then the lines that say what the
# kernel made of the machine.
dmesg_all() {
	dmesg -r | grep '^<[0-4]>' | sed 's/^/RG-DMESG: /'
	dmesg | grep -E 'ACPI: |smpboot|x86/PAT|i8042|clocksource|vmgenid|virtio|MTRR|APIC' | sed 's/^/RG-KLOG: /'
}

# Kernel messages at warning level or worse since the last call (and clears them).
new_warnings() {
	dmesg -r -c | grep '^<[0-4]>' | sed 's/^/RG-DMESG: /'
}

# A write the read-only share must refuse:
# "RG-FSRO <mount> <op> refused: <error>" or "RG-FSRO <mount> <op> succeeded".
ro_try() {
	where=$1 op=$2
	shift 2
	if out=$("$@" </dev/null 2>&1); then
		say "RG-FSRO $where $op succeeded"
	else
		say "RG-FSRO $where $op refused: $(echo "$out" | tail -n 1)"
	fi
}
ro_tries() {
	ro_try "$2" create sh -c "echo new >$1/new.txt"
	ro_try "$2" append sh -c "echo more >>$1/ro.txt"
	ro_try "$2" mkdir mkdir "$1/newdir"
	ro_try "$2" remove rm -f "$1/ro.txt"
}

# Answers lines from the console until "end": "ping" with RG-PONG (and the
# share's small.txt when there is a share), "after TOKEN" with the checks
# of a restored share guest (share mode).
serve_console() {
	while read -r cmd token; do
		case "$cmd" in
		ping)
			if [ -d /mnt/rgshare ]; then
				say "RG-PONG $(cat /mnt/rgshare/small.txt 2>&1)"
			else
				say "RG-PONG idle"
			fi
			;;
		after)
			say "RG-FS-AFTER-BIG $(sha256sum /mnt/rgshare/big.bin 2>&1 | cut -d' ' -f1)"
			say "RG-FS-AFTER-HELD $(sha256sum <&3 2>&1 | cut -d' ' -f1)"
			say "RG-FS-AFTER-NEW $(cat /mnt/rgshare/after.txt 2>&1)"
			say "RG-FS-AFTER-RO $(cat /mnt/rgro/ro.txt 2>&1)"
			if echo "$token" >/mnt/rgshare/after-guest.txt 2>/tmp/err; then
				say "RG-FS-AFTER-WROTE ok"
			else
				say "RG-FS-AFTER-WROTE failed: $(cat /tmp/err)"
			fi
			new_warnings
			say "RG-FS-AFTER-DONE"
			;;
		end) break ;;
		esac
	done
}

net_up() {
	ip link set lo up
	ip link set eth0 up || return 1
	ip addr add "$ip4" dev eth0 || return 1
}

case "$mode" in
boot)
	facts
	dmesg_all
	;;
serial)
	# Lines the host wrote before this point (before the UART was set up)
	# must not show up here; the runner starts writing when it sees READY.
	say "RG-SERIAL-READY"
	n=0
	while [ $n -lt 3 ]; do
		if read -t 120 line; then say "RG-SERIAL-GOT $line"; else say "RG-SERIAL-NOTHING"; break; fi
		n=$((n + 1))
	done
	;;
virtio)
	say "RG-FACT cmdline $(cat /proc/cmdline)"
	load_modules 5
	# Block, read-write: the host's ext4 image on /dev/vda.
	mkdir -p /tmp/mnt
	if mount -t ext4 /dev/vda /tmp/mnt; then
		say "RG-BLK-READ $(cat /tmp/mnt/hello.txt)"
		dd if=/dev/urandom of=/tmp/mnt/fromguest.bin bs=1M count=4 2>/dev/null
		sync
		say "RG-BLK-WROTE $(sha256sum /tmp/mnt/fromguest.bin | cut -d' ' -f1)"
		umount /tmp/mnt && say "RG-BLK-UMOUNT ok"
	else
		say "RG-BLK-MOUNT failed"
	fi
	# Block, read-only: /dev/vdb.
	say "RG-BLK-RO-FLAG $(cat /sys/block/vdb/ro 2>/dev/null)"
	if dd if=/dev/zero of=/dev/vdb bs=4096 count=1 oflag=direct conv=fsync 2>/dev/null; then
		say "RG-BLK-RO-WRITE succeeded"
	else
		say "RG-BLK-RO-WRITE refused"
	fi
	say "RG-BLK-RO-READ $(dd if=/dev/vdb bs=4096 count=1 2>/dev/null | sha256sum | cut -d' ' -f1)"
	# Entropy.
	say "RG-RNG $(cat /sys/class/misc/hw_random/rng_current 2>/dev/null) $(dd if=/dev/hwrng bs=32 count=1 2>/dev/null | hex)"
	# Network: ping and a TCP exchange with the L1 side of the tap.
	if net_up; then
		if ping -c 3 -W 5 "$peer" >/tmp/ping 2>&1; then say "RG-NET-PING ok"; else say "RG-NET-PING failed: $(tail -n 2 /tmp/ping | tr '\n' '|')"; fi
		say "RG-NET-TCP $(echo hello-from-guest | nc -w 10 "$peer" 7000 2>&1 | tr '\n' ' ')"
	else
		say "RG-NET-UP failed"
	fi
	# vsock, guest -> host: 10 MiB to the host's listener on port 5000.
	dd if=/dev/urandom of=/tmp/g2h bs=1M count=10 2>/dev/null
	say "RG-VSOCK-G2H-SENT $(sha256sum /tmp/g2h | cut -d' ' -f1)"
	say "RG-VSOCK-G2H-REPLY $(timeout 120 /mods/vsockcat connect 5000 </tmp/g2h 2>&1 | tr '\n' ' ')"
	rm -f /tmp/g2h
	# vsock, host -> guest: the host connects to port 1024 and sends 10 MiB.
	(timeout 180 /mods/vsockcat listen 1024 </dev/null >/tmp/h2g 2>/tmp/h2g.err; echo $? >/tmp/h2g.rc) &
	sleep 0.5
	say "RG-VSOCK-LISTENING 1024"
	wait
	say "RG-VSOCK-H2G-GOT rc=$(cat /tmp/h2g.rc) bytes=$(wc -c </tmp/h2g) sha256=$(sha256sum /tmp/h2g | cut -d' ' -f1) $(cat /tmp/h2g.err)"
	rm -f /tmp/h2g
	sed -n '/virtio\|LOC/p' /proc/interrupts | sed 's/^/RG-IRQ: /'
	;;
tick)
	# A running guest for snapshots: every second it writes its disk, reads
	# virtio-rng, opens a new TCP connection to L1 and prints what it saw,
	# with every new kernel message. vsock port 1024 echoes.
	load_modules 4
	mkdir -p /tmp/mnt
	mount -t ext4 /dev/vda /tmp/mnt && say "RG-TICK-DISK mounted"
	net_up || say "RG-NET-UP failed"
	/mods/vsockcat echo 1024 &
	dmesg -c >/dev/null
	i=0
	while :; do
		up=$(cut -d' ' -f1 /proc/uptime)
		echo "tick $i" >/tmp/mnt/tick && sync
		r=$(dd if=/dev/hwrng bs=8 count=1 2>/dev/null | hex)
		t=$(echo "tick $i" | nc -w 3 "$peer" 7000 2>&1 | tr '\n' ' ')
		say "RG-TICK $i uptime=$up rng=$r disk=$(cat /tmp/mnt/tick | tr ' ' _) tcp=$t"
		dmesg -r -c | grep '^<[0-4]>' | sed 's/^/RG-DMESG: /'
		i=$((i + 1))
		sleep 1
	done
	;;
urandom)
	# Two clones of one snapshot must not read the same bytes after restore.
	i=0
	while :; do
		say "RG-URANDOM $i $(dd if=/dev/urandom bs=16 count=1 2>/dev/null | hex)"
		i=$((i + 1))
		sleep 1
	done
	;;
share)
	# Two virtio-fs shares: rgshare (read-write, holding big.bin, 100 MiB of
	# the host's random bytes, and small.txt) and rgro (virtiofsd --readonly,
	# holding ro.txt). Then, with big.bin held open on fd 3 and 1 MiB read
	# from it, the runner snapshots the guest and restores it onto fresh
	# virtiofsd processes, and sends "after TOKEN".
	load_modules 2
	mkdir -p /mnt/rgshare /mnt/rgro
	if mount -t virtiofs rgshare /mnt/rgshare 2>/tmp/err; then
		say "RG-FS-MOUNT ok $(grep ' /mnt/rgshare ' /proc/mounts)"
	else
		say "RG-FS-MOUNT failed: $(cat /tmp/err)"
	fi
	say "RG-FS-BIG $(sha256sum /mnt/rgshare/big.bin 2>&1 | cut -d' ' -f1)"
	if echo "written by the guest" >/mnt/rgshare/from-guest.txt 2>/tmp/err; then
		say "RG-FS-WROTE ok"
	else
		say "RG-FS-WROTE failed: $(cat /tmp/err)"
	fi
	if mount -t virtiofs -o ro rgro /mnt/rgro 2>/tmp/err; then
		say "RG-FSRO-MOUNT ro ok $(grep ' /mnt/rgro ' /proc/mounts)"
		say "RG-FSRO-READ ro $(cat /mnt/rgro/ro.txt 2>&1)"
		ro_tries /mnt/rgro ro
		umount /mnt/rgro
	else
		say "RG-FSRO-MOUNT ro failed: $(cat /tmp/err)"
	fi
	# Mounted read-write, the share is still read-only: virtiofsd refuses.
	if mount -t virtiofs rgro /mnt/rgro 2>/tmp/err; then
		say "RG-FSRO-MOUNT rw ok $(grep ' /mnt/rgro ' /proc/mounts)"
		say "RG-FSRO-READ rw $(cat /mnt/rgro/ro.txt 2>&1)"
		ro_tries /mnt/rgro rw
	else
		say "RG-FSRO-MOUNT rw failed: $(cat /tmp/err)"
	fi
	# (A failed redirection of exec would end this shell, PID 1.)
	if [ -r /mnt/rgshare/big.bin ]; then
		exec 3</mnt/rgshare/big.bin
		dd bs=1M count=1 <&3 >/dev/null 2>&1
	fi
	new_warnings
	say "RG-FS-SNAPSHOT-READY"
	serve_console
	;;
fsperf)
	# Sequential reads of the same 100 MiB file through virtio-fs (rgshare)
	# and from an ext4 virtio-blk disk (/dev/vda), caches dropped before
	# each, rg.rounds rounds alternating; then rg.files files created,
	# stat'ed and unlinked on each.
	load_modules 2
	mkdir -p /mnt/rgshare /mnt/blk
	mount -t virtiofs rgshare /mnt/rgshare 2>&1 | sed 's/^/RG-PERF-MOUNT rgshare: /'
	mount -t ext4 /dev/vda /mnt/blk 2>&1 | sed 's/^/RG-PERF-MOUNT blk: /'
	round=1
	while [ "$round" -le "${rounds:-3}" ]; do
		for where in rgshare blk; do
			sync
			echo 3 >/proc/sys/vm/drop_caches
			say "RG-PERF read $where $round $(/mods/fsbench read /mnt/$where/big.bin 2>&1)"
		done
		round=$((round + 1))
	done
	for where in rgshare blk; do
		mkdir -p /mnt/$where/meta
		say "RG-PERF meta $where $(/mods/fsbench meta /mnt/$where/meta "${files:-500}" 2>&1)"
	done
	new_warnings
	;;
idle)
	# A guest without shares for restore timings: answers pings.
	say "RG-IDLE-READY"
	serve_console
	;;
*)
	say "RG-ERROR unknown rg.mode '$mode'"
	;;
esac

say "RG-DONE uptime=$(cut -d' ' -f1 /proc/uptime)"
case "$end" in
poweroff) poweroff -f ;;
none) while :; do sleep 3600; done ;;
*) reboot -f ;;
esac
