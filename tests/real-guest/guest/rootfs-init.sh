#!/bin/sh
# /init of the real-guest boot initramfs for kernels that build their virtio
# and netfilter drivers as modules (Debian's): loads them, mounts the
# project's root filesystem from /dev/vda and hands over to its /sbin/init
# (guest-init). Kernels with everything built in (the images kernel) boot the
# root filesystem directly and never use this.
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /mods/order); do
	insmod "/mods/$m" 2>&1 | sed "s/^/rootfs-init: insmod $m: /"
done
n=0
while [ ! -b /dev/vda ] && [ $n -lt 100 ]; do sleep 0.1; n=$((n + 1)); done
mkdir -p /newroot
if ! mount -t ext4 -o rw /dev/vda /newroot; then
	echo "rootfs-init: cannot mount /dev/vda; devices: $(ls /sys/bus/virtio/devices | tr '\n' ' ')"
	sleep 1
	poweroff -f
fi
umount /proc /sys /dev
exec switch_root /newroot /sbin/init
