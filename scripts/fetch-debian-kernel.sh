#!/usr/bin/env bash
# Fetches Debian's linux-image-cloud-amd64 kernel from the Debian archive and
# leaves, in DIR (default: target/debian-kernel):
#   bzImage   the package's /boot/vmlinuz (a bzImage)
#   vmlinux   the ELF kernel inside it (the bzImage payload, decompressed)
#   version   the package name and version
# Used by vmm's tests that load (not run) real Linux images. Cached: a second
# run with the files present does nothing.
set -euo pipefail

dir=${1:-target/debian-kernel}
if [[ -s $dir/bzImage && -s $dir/vmlinux && -s $dir/version ]]; then
    echo "debian kernel: cached in $dir ($(cat "$dir/version"))"
    exit 0
fi
for tool in apt-get apt-cache dpkg-deb od dd; do
    command -v "$tool" >/dev/null || { echo "fetch-debian-kernel: $tool is missing" >&2; exit 1; }
done

mkdir -p "$dir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The metapackage depends on the current versioned image package.
pkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
if [[ -z $pkg ]]; then
    echo "fetch-debian-kernel: linux-image-cloud-amd64 not found; run apt-get update first" >&2
    exit 1
fi
echo "debian kernel: downloading $pkg"
(cd "$work" && apt-get download -q "$pkg" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
deb=$(ls "$work"/*.deb)
dpkg-deb -x "$deb" "$work/root"
vmlinuz=$(ls "$work"/root/boot/vmlinuz-*)
cp "$vmlinuz" "$work/bzImage"

# bzImage layout: setup_sects at 0x1f1; payload_offset/length (boot protocol 2.08+)
# at 0x248/0x24c, relative to the protected-mode code at (setup_sects + 1) * 512.
u8() { od -An -tu1 -j "$2" -N1 "$1" | tr -d ' '; }
u32() { od -An -tu4 -j "$2" -N4 "$1" | tr -d ' '; }
setup_sects=$(u8 "$work/bzImage" $((0x1f1)))
payload_offset=$(u32 "$work/bzImage" $((0x248)))
payload_length=$(u32 "$work/bzImage" $((0x24c)))
start=$(( (setup_sects + 1) * 512 + payload_offset ))
dd if="$work/bzImage" of="$work/payload" bs=4M iflag=skip_bytes,count_bytes \
    skip="$start" count="$payload_length" status=none

magic=$(od -An -tx1 -N4 "$work/payload" | tr -d ' ')
case $magic in
    02214c18) tool=(lz4 -dc) ;;          # LZ4 legacy frame
    28b52ffd) tool=(zstd -dc) ;;
    fd377a58) tool=(xz -dc) ;;
    1f8b*) tool=(gzip -dc) ;;
    *) echo "fetch-debian-kernel: unknown payload compression (magic $magic)" >&2; exit 1 ;;
esac
command -v "${tool[0]}" >/dev/null || { echo "fetch-debian-kernel: ${tool[0]} is needed to decompress the kernel (apt-get install ${tool[0]})" >&2; exit 1; }
"${tool[@]}" "$work/payload" > "$work/vmlinux" 2>/dev/null || true
[[ $(od -An -tx1 -N4 "$work/vmlinux" | tr -d ' ') == 7f454c46 ]] || { echo "fetch-debian-kernel: decompressed payload is not an ELF" >&2; exit 1; }

mv "$work/bzImage" "$work/vmlinux" "$dir/"
echo "$pkg $(dpkg-deb -f "$deb" Version)" > "$dir/version"
echo "debian kernel: $(cat "$dir/version") in $dir"
