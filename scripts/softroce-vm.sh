#!/usr/bin/env bash
# Run a command where a SoftRoCE device (rxe0 on lo) exists, and exit with its status.
#
#   scripts/softroce-vm.sh 'CMD ...'
#
# * If this host's kernel has rdma_rxe (modprobe works), rxe0 is added on lo if missing and
#   CMD runs here directly.
# * Otherwise (e.g. CI kernels without RDMA) CMD runs inside a throwaway QEMU VM: Debian's
#   kernel package (fetched with apt-get download and unpacked), a busybox initramfs that
#   loads rdma_rxe and adds rxe0 on lo, the host root shared read-only over 9p and the
#   current directory (or $VM_WORK) shared read-write at the same path. TCG only: nested KVM
#   hangs on the machines this was written for. Boot takes ~20 s; the emulated CPU is slow.
#
# Installs what it needs from Debian packages (qemu-system-x86, rdma-core, ibverbs-providers,
# ibverbs-utils, perftest, busybox-static, cpio, kmod, iproute2). Environment variables named
# KVWIRE_* and RUST_* are passed into the VM. Knobs: VM_CACHE (kernel/initramfs cache),
# VM_TIMEOUT (seconds, default 900), VM_MEM (MiB, default 4096), VM_CPUS (default 2),
# KVWIRE_SOFTROCE=vm|host (force a mode).
set -euo pipefail

if [ $# -lt 1 ]; then
  echo "usage: $0 'command ...'" >&2
  exit 2
fi
CMD="$*"

need=()
for p in rdma-core ibverbs-providers ibverbs-utils perftest iproute2 kmod; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
install() {
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

host_has_rxe() {
  [ "${KVWIRE_SOFTROCE:-}" = vm ] && return 1
  modprobe rdma_rxe >/dev/null 2>&1 || return 1
  command -v rdma >/dev/null 2>&1 || return 1
}

if ((${#need[@]})); then install "${need[@]}"; fi

if [ "${KVWIRE_SOFTROCE:-}" != vm ] && host_has_rxe; then
  ip link set lo up
  rdma link show rxe0 >/dev/null 2>&1 || rdma link add rxe0 type rxe netdev lo
  echo "softroce: host kernel has rdma_rxe; running on the host" >&2
  exec bash -c "$CMD"
fi
if [ "${KVWIRE_SOFTROCE:-}" = host ]; then
  echo "softroce: KVWIRE_SOFTROCE=host but this kernel has no rdma_rxe" >&2
  exit 3
fi

vm_need=()
for p in qemu-system-x86 busybox-static cpio; do
  dpkg -s "$p" >/dev/null 2>&1 || vm_need+=("$p")
done
if ((${#vm_need[@]})); then install "${vm_need[@]}"; fi

CACHE=${VM_CACHE:-/tmp/kvwire-softroce}
WORK=$(realpath "${VM_WORK:-$PWD}")
mkdir -p "$CACHE"

if [ ! -f "$CACHE/vmlinuz" ]; then
  echo "softroce: fetching Debian's kernel package" >&2
  (
    cd "$CACHE"
    pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
    [ -n "$pkg" ] || { echo "softroce: no linux-image package found (run apt-get update?)" >&2; exit 1; }
    apt-get download "$pkg" >/dev/null 2>&1
    rm -rf k && mkdir -p k && dpkg -x linux-image-*.deb k
    cp k/boot/vmlinuz-* vmlinuz
    rm -f linux-image-*.deb
  )
fi

MODS="virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci netfs fscache 9pnet 9pnet_virtio 9p crc32_generic crc32-pclmul ib_core ib_uverbs udp_tunnel ip6_udp_tunnel rdma_rxe"
R="$CACHE/initrd"
if [ ! -f "$R/init" ]; then
  rm -rf "$R"
  mkdir -p "$R"/{bin,mod,proc,sys,dev,host}
  cp /bin/busybox "$R/bin/"
  for m in $MODS; do find "$CACHE/k/lib/modules" -name "$m.ko*" -exec cp {} "$R/mod/" \; ; done
  # Compressed modules (.ko.xz/.ko.zst) are decompressed for busybox insmod.
  for f in "$R"/mod/*.ko.xz; do [ -e "$f" ] && xz -d "$f"; done
  for f in "$R"/mod/*.ko.zst; do [ -e "$f" ] && zstd -q -d --rm "$f"; done
  cat > "$R/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $(cat /mods); do [ -f /mod/$m.ko ] && insmod /mod/$m.ko; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000 hostroot /host
mount -t proc proc /host/proc; mount -t sysfs sys /host/sys; mount -t devtmpfs dev /host/dev
mount -t tmpfs tmp /host/tmp; mount -t tmpfs run /host/run
W=$(cat /workdir); mkdir -p /host$W 2>/dev/null
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 work /host$W
chroot /host /bin/bash -c "cd $W && ip link set lo up && rdma link add rxe0 type rxe netdev lo && bash $W/.vm-cmd.sh; echo VM_EXIT=\$?"
poweroff -f
INIT
  chmod +x "$R/init"
  echo "$MODS" > "$R/mods"
fi
echo "$WORK" > "$R/workdir"
(cd "$R" && find . | cpio -o -H newc 2>/dev/null | gzip -1 > "$CACHE/initrd.gz")

# The command, with the caller's KVWIRE_* and RUST_* variables.
{
  env | grep -E '^(KVWIRE|RUST)_[A-Za-z0-9_]*=' | sed -e "s/'/'\\\\''/g" -e "s/=\(.*\)/='\1'/" -e 's/^/export /' || true
  printf '%s\n' "$CMD"
} > "$WORK/.vm-cmd.sh"
trap 'rm -f "$WORK/.vm-cmd.sh"' EXIT

log="$CACHE/vm.log"
set +e
timeout "${VM_TIMEOUT:-900}" qemu-system-x86_64 -accel tcg,thread=multi -cpu max -m "${VM_MEM:-4096}" -smp "${VM_CPUS:-2}" \
  -nographic -no-reboot -kernel "$CACHE/vmlinuz" -initrd "$CACHE/initrd.gz" \
  -append "console=ttyS0 panic=-1 edd=off quiet" \
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
  -virtfs local,path="$WORK",mount_tag=work,security_model=none,multidevs=remap 2>&1 \
  | tr -d '\r' | sed -e 's/\x1b\[[0-9;?]*[a-zA-Z]//g' -e 's/\x1bc//g' \
  | awk 'go{print} /Booting from ROM/{go=1} /^VM_EXIT=/{exit}' | grep -v -e '^Booting from ROM' -e 'Multiple devices detected' \
  | tee "$log"
set -e
code=$(sed -n 's/^VM_EXIT=\([0-9]*\).*/\1/p' "$log" | tail -n 1)
if [ -z "$code" ]; then
  echo "softroce: the VM did not report an exit status (boot failure or timeout)" >&2
  exit 124
fi
exit "$code"
