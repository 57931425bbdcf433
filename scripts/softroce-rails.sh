#!/usr/bin/env bash
# Two SoftRoCE hosts joined by two links ("rails"): run CMD_A in VM a and CMD_B in VM b, and
# exit with the first non-zero status of the two (or 0).
#
#   scripts/softroce-rails.sh 'CMD_A ...' 'CMD_B ...'
#
# Each VM has two virtio NICs. NIC i of VM a and NIC i of VM b are the two ends of one
# emulated link (a QEMU socket netdev over host loopback): rail 0 is 10.0.0.0/24, rail 1
# is 10.0.1.0/24; VM a is .1 and VM b is .2 on both. Each NIC carries a SoftRoCE device:
# rxe0 on eth0, rxe1 on eth1. Taking a rail down: `ip link set eth1 down` inside a VM (rxe
# reports the port down; nothing crosses the link until it is set up again).
#
# The kernel and modules are those scripts/softroce-vm.sh fetches (run here first when its
# cache is empty); the host root is shared read-only over 9p and the current directory (or
# $VM_WORK) read-write at the same path, in both VMs. The two commands run at once; a file
# in the shared directory is how they meet (e.g. VM b's listener writes its address, VM a
# waits for it). Knobs: VM_CACHE, VM_TIMEOUT (default 900 s), VM_MEM (MiB per VM, default
# 2048), VM_CPUS (per VM, default 1). Environment variables named KVWIRE_* and RUST_* are
# passed into both VMs, with KVWIRE_VM set to `a` or `b`.
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 'command in VM a' 'command in VM b'" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
CACHE=${VM_CACHE:-/tmp/kvwire-softroce}
WORK=$(realpath "${VM_WORK:-$PWD}")
if [ ! -f "$CACHE/vmlinuz" ] || [ ! -d "$CACHE/k/lib/modules" ]; then
  VM_CACHE="$CACHE" KVWIRE_SOFTROCE=vm bash "$here/softroce-vm.sh" true
fi

MODS="virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci netfs fscache 9pnet 9pnet_virtio 9p failover net_failover virtio_net crc32_generic crc32-pclmul ib_core ib_uverbs udp_tunnel ip6_udp_tunnel rdma_rxe"
R="$CACHE/initrd-rails"
rm -rf "$R"
mkdir -p "$R"/{bin,mod,proc,sys,dev,host}
cp /bin/busybox "$R/bin/"
for m in $MODS; do find "$CACHE/k/lib/modules" -name "$m.ko*" -exec cp {} "$R/mod/" \; ; done
for f in "$R"/mod/*.ko.xz; do [ -e "$f" ] && xz -d "$f"; done
for f in "$R"/mod/*.ko.zst; do [ -e "$f" ] && zstd -q -d --rm "$f"; done
echo "$MODS" > "$R/mods"
echo "$WORK" > "$R/workdir"
cat > "$R/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $(cat /mods); do [ -f /mod/$m.ko ] && insmod /mod/$m.ko; done
vm=$(sed -n 's/.*kvwire_vm=\([ab]\).*/\1/p' /proc/cmdline)
host=1; [ "$vm" = b ] && host=2
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000 hostroot /host
mount -t proc proc /host/proc; mount -t sysfs sys /host/sys; mount -t devtmpfs dev /host/dev
mount -t tmpfs tmp /host/tmp; mount -t tmpfs run /host/run
W=$(cat /workdir); mkdir -p /host$W 2>/dev/null
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 work /host$W
chroot /host /bin/bash -c "cd $W && ip link set lo up &&
  for i in 0 1; do ip link set eth\$i up && ip addr add 10.0.\$i.$host/24 dev eth\$i && rdma link add rxe\$i type rxe netdev eth\$i; done &&
  export KVWIRE_VM=$vm && bash $W/.vm-cmd-$vm.sh; rc=\$?; echo \$rc >$W/.vm-exit-$vm; sync; echo VM_EXIT=\$rc"
poweroff -f
INIT
chmod +x "$R/init"
(cd "$R" && find . | cpio -o -H newc 2>/dev/null | gzip -1 > "$CACHE/initrd-rails.gz")

for vm in a b; do
  cmd=$1; [ "$vm" = b ] && cmd=$2
  {
    env | grep -E '^(KVWIRE|RUST)_[A-Za-z0-9_]*=' | sed -e "s/'/'\\\\''/g" -e "s/=\(.*\)/='\1'/" -e 's/^/export /' || true
    printf '%s\n' "$cmd"
  } > "$WORK/.vm-cmd-$vm.sh"
done
rm -f "$WORK/.vm-exit-a" "$WORK/.vm-exit-b"
trap 'rm -f "$WORK/.vm-cmd-a.sh" "$WORK/.vm-cmd-b.sh" "$WORK/.vm-exit-a" "$WORK/.vm-exit-b"' EXIT

# Two free TCP ports on host loopback for the two links.
ports=$(python3 -c 'import socket
s=[socket.socket() for _ in range(2)]
[x.bind(("127.0.0.1",0)) for x in s]
print(" ".join(str(x.getsockname()[1]) for x in s))')
set -- $ports
p0=$1 p1=$2

boot() {
  local vm=$1 mode=$2 n=1
  [ "$vm" = b ] && n=2
  timeout "${VM_TIMEOUT:-900}" qemu-system-x86_64 -accel tcg,thread=multi -cpu max \
    -m "${VM_MEM:-2048}" -smp "${VM_CPUS:-1}" -nographic -no-reboot \
    -kernel "$CACHE/vmlinuz" -initrd "$CACHE/initrd-rails.gz" \
    -append "console=ttyS0 panic=-1 edd=off quiet kvwire_vm=$vm" \
    -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
    -virtfs local,path="$WORK",mount_tag=work,security_model=none,multidevs=remap \
    -netdev socket,id=r0,$mode=127.0.0.1:$p0 -device virtio-net-pci,netdev=r0,mac=52:54:00:00:00:0$n \
    -netdev socket,id=r1,$mode=127.0.0.1:$p1 -device virtio-net-pci,netdev=r1,mac=52:54:00:00:01:0$n 2>&1 \
    | tr -d '\r' | sed -e 's/\x1b\[[0-9;?]*[a-zA-Z]//g' -e 's/\x1bc//g' \
    | awk 'go{print} /Booting from ROM/{go=1} /^VM_EXIT=/{exit}' | grep -v -e '^Booting from ROM' -e 'Multiple devices detected' \
    | sed -u "s/^/[$vm] /" | tee "$CACHE/vm-$vm.log"
}
set +e
boot b listen &
pb=$!
sleep 1
boot a connect &
pa=$!
wait $pa $pb
set -e
status=0
for vm in a b; do
  # The status comes back in a file of the shared directory (the serial console, shared by
  # the command's output and the kernel's, can drop lines).
  code=$(cat "$WORK/.vm-exit-$vm" 2>/dev/null || true)
  if [ -z "$code" ]; then
    echo "softroce-rails: VM $vm did not report an exit status (boot failure or timeout)" >&2
    code=124
  fi
  [ "$status" -eq 0 ] && status=$code
done
exit "$status"
