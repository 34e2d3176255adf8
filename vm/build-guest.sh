#!/usr/bin/env bash
# Builds memtide's test guest from Debian packages only, without network beyond the Debian
# archive: the kernel (and its virtio-balloon driver) from linux-image-amd64, and an initramfs
# whose whole user space is vm/init.c compiled static. Writes OUT/vmlinuz and OUT/initramfs
# (default OUT: target/guest). Run the guest with vm/run-guest.sh, or by hand:
#
#   qemu-system-x86_64 -m 2G -kernel OUT/vmlinuz -initrd OUT/initramfs \
#     -append "console=ttyS0 fill_mib=1536" -nodefaults -display none -serial stdio -no-reboot
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/../target/guest}
mkdir -p "$out"
out=$(cd "$out" && pwd)

need=()
command -v gcc >/dev/null 2>&1 || need+=(gcc)
[ -f /usr/lib/x86_64-linux-gnu/libc.a ] || need+=(libc6-dev)
command -v qemu-system-x86_64 >/dev/null 2>&1 || need+=(qemu-system-x86)
command -v python3 >/dev/null 2>&1 || need+=(python3)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ ! -f "$out/vmlinuz" ] || [ ! -d "$out/modules" ]; then
  pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-/ {print $2; exit}')
  if [ -z "$pkg" ]; then
    apt-get update -qq
    pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/ {print $2; exit}')
  fi
  [ -n "$pkg" ] || { echo "build-guest: cannot find the package behind linux-image-amd64" >&2; exit 1; }
  echo "build-guest: fetching $pkg"
  (cd "$work" && apt-get download -q "$pkg" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
  deb=$(ls "$work"/linux-image-*.deb 2>/dev/null | head -1)
  [ -n "$deb" ] || { echo "build-guest: downloading $pkg failed" >&2; exit 1; }
  dpkg-deb -x "$deb" "$work/kernel"
  cp "$work"/kernel/boot/vmlinuz-* "$out/vmlinuz"
  mkdir -p "$out/modules"
  for m in virtio virtio_ring virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_balloon; do
    f=$(find "$work/kernel/lib/modules" -name "$m.ko" | head -1)
    [ -n "$f" ] || { echo "build-guest: $pkg has no $m.ko" >&2; exit 1; }
    cp "$f" "$out/modules/"
  done
fi

gcc -O2 -static -Wall -Wextra -o "$work/init" "$here/init.c"

# The initramfs: a newc cpio archive holding /init, /dev/console and the driver modules.
python3 - "$work/init" "$out/modules" "$out/initramfs" <<'PY'
import os, sys
init, modules, dest = sys.argv[1:4]
entries = [("dev", 0o040755, b""), ("dev/console", 0o020600, b""), ("modules", 0o040755, b"")]
for name in sorted(os.listdir(modules)):
    entries.append(("modules/" + name, 0o100644, open(os.path.join(modules, name), "rb").read()))
entries.append(("init", 0o100755, open(init, "rb").read()))
def pad(n):
    return b"\0" * (-n % 4)
out = bytearray()
for ino, (name, mode, data) in enumerate(entries + [("TRAILER!!!", 0, b"")], 1):
    rdev = (5, 1) if name == "dev/console" else (0, 0)
    nlink = 2 if mode & 0o040000 else 1
    fields = [ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rdev[0], rdev[1], len(name) + 1, 0]
    head = b"070701" + b"".join(b"%08X" % f for f in fields)
    out += head + name.encode() + b"\0"
    out += pad(len(head) + len(name) + 1)
    out += data + pad(len(data))
open(dest, "wb").write(bytes(out))
PY
echo "build-guest: $out/vmlinuz, $out/initramfs ($(du -k "$out/initramfs" | cut -f1) KiB)"
